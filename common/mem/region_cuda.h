/* kvbank — device memory on CUDA GPUs: the `cuda` memory backend beside the host one in region.h.
 *
 *  - device regions: one cudaMalloc allocation that another process maps through a CUDA IPC handle
 *    (cudaIpcMemHandle_t, 64 bytes, written as 128 lower-case hex characters): what a worker lends;
 *  - pinned host buffers (cudaHostAlloc): the host tier and staging for overlapped copies;
 *  - streams and events: ordering and overlapping copies with compute;
 *  - the driver's virtual memory (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess,
 *    cuMemUnmap) as primitives; common/mem/mem_cuda.c builds the memory interface's chunks and
 *    reservations (mem.h) on them.
 *
 * Every object here belongs to the device that was current on the calling thread when it was created
 * (cudaSetDevice; CUDA_VISIBLE_DEVICES picks the GPU of a process). Nothing in this header needs a CUDA
 * header: types are opaque, streams are `kvb_cuda_stream_t`, CUDA error codes travel as int.
 * Only built with CUDA (configure defines KVB_WITH_CUDA); code above the mem and kernels layers does not
 * include this header. The driver API (VMM, address ranges) is reached through
 * cudaGetDriverEntryPointByVersion, so no program links libcuda directly: a binary built here starts
 * on a machine without an NVIDIA driver and reports "no CUDA device" instead of failing to load. */
#ifndef KVB_MEM_REGION_CUDA_H
#define KVB_MEM_REGION_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A CUDA stream. The same type as the runtime's cudaStream_t (a pointer to the opaque CUstream_st),
 * spelled so that C code can hold one without CUDA's headers. NULL would be the legacy default stream,
 * which kvbank never uses. */
typedef struct CUstream_st *kvb_cuda_stream_t;

/* ---------------------------------------------------------------- errors */

/* Turns a CUDA runtime error code (cudaError_t as int) into a kvb_status: KVB_OK for cudaSuccess,
 * KVB_ERR_NOMEM for cudaErrorMemoryAllocation, KVB_ERR_UNSUPPORTED for "no device"/"no driver",
 * KVB_ERR_BACKEND otherwise; logs the runtime's name and message with the failing expression. */
kvb_status kvb__cuda_status(int err, const char *expr, const char *file, int line);
/* The same for a CUDA driver API result (CUresult as int), message from cuGetErrorString. */
kvb_status kvb__cu_status(int res, const char *expr, const char *file, int line);

/* KVB_CUDA_CHECK(call) evaluates a CUDA runtime call (or a kernels/cuda launcher, which returns the
 * launch's cudaError_t as int) and yields a kvb_status; compose it with KVB_TRY / KVB_TRY_GOTO:
 *     KVB_TRY(KVB_CUDA_CHECK(cudaMemcpyAsync(...)));
 * KVB_CUDA_DRV_CHECK(call) does the same for driver API calls (CUresult). */
#define KVB_CUDA_CHECK(call) kvb__cuda_status((int)(call), #call, __FILE__, __LINE__)
#define KVB_CUDA_DRV_CHECK(call) kvb__cu_status((int)(call), #call, __FILE__, __LINE__)

/* Number of CUDA devices this process sees. On a machine without a GPU or driver, *n = 0 and the
 * runtime's reason is copied into `why` (may be NULL; `why_len` bytes incl. terminator); never logs
 * as an error. Returns KVB_OK in both cases. */
kvb_status kvb_cuda_device_count(int *n, char *why, size_t why_len);

/* ---------------------------------------------------------------- device regions */

typedef struct kvb_cuda_region kvb_cuda_region;

/* Characters of a region handle (64 bytes as hex), and the buffer size that holds it with its NUL. */
#define KVB_CUDA_HANDLE_CHARS 128
#define KVB_CUDA_HANDLE_MAX (KVB_CUDA_HANDLE_CHARS + 1)

/* Allocates `bytes` (> 0) of device memory on the current device, zero-filled, exportable by handle.
 * Caller owns the result. KVB_ERR_NOMEM when the device is full, KVB_ERR_UNSUPPORTED without device. */
kvb_status kvb_cuda_region_create(size_t bytes, kvb_cuda_region **out);
/* Opens a region exported by ANOTHER process (CUDA IPC cannot open a handle in the process that made
 * it: that is KVB_ERR_INVALID here). `bytes` is the size the exporter announced; the mapping must be at
 * least that large (checked with cuMemGetAddressRange where the driver answers it). KVB_ERR_INVALID
 * for a malformed handle.
 * Destroying the result closes the mapping; the exporter's memory stays valid until the exporter frees
 * it, and it must not free it while this process may still read it (the reclaim fence). */
kvb_status kvb_cuda_region_import(const char *handle, size_t bytes, kvb_cuda_region **out);
/* Frees (owner) or closes (importer) the region. Waits for the device first: no kernel may still
 * read it. NULL-safe. */
void kvb_cuda_region_destroy(kvb_cuda_region *r);

void *kvb_cuda_region_base(const kvb_cuda_region *r);  /* device address */
size_t kvb_cuda_region_size(const kvb_cuda_region *r);
const char *kvb_cuda_region_handle(const kvb_cuda_region *r); /* 128 hex chars, owned by the region */
int kvb_cuda_region_is_owner(const kvb_cuda_region *r);
/* 1 if `s` is KVB_CUDA_HANDLE_CHARS lower- or upper-case hex digits, nothing more. */
int kvb_cuda_handle_valid(const char *s);

/* ---------------------------------------------------------------- pinned host buffers */

typedef struct kvb_cuda_pinned kvb_cuda_pinned;

/* `bytes` (> 0) of page-locked host memory, usable by every device (cudaHostAllocPortable), so that
 * copies to and from it run asynchronously. Uninitialised. Caller owns the result. */
kvb_status kvb_cuda_pinned_create(size_t bytes, kvb_cuda_pinned **out);
void kvb_cuda_pinned_destroy(kvb_cuda_pinned *p); /* NULL-safe */
void *kvb_cuda_pinned_base(const kvb_cuda_pinned *p);
size_t kvb_cuda_pinned_size(const kvb_cuda_pinned *p);

/* ---------------------------------------------------------------- streams, copies, events */

/* A stream that does not synchronise with the legacy default stream (cudaStreamNonBlocking).
 * Destroy with kvb_cuda_stream_destroy (NULL-safe; waits for the stream's work). */
kvb_status kvb_cuda_stream_create(kvb_cuda_stream_t *out);
void kvb_cuda_stream_destroy(kvb_cuda_stream_t s);
kvb_status kvb_cuda_stream_sync(kvb_cuda_stream_t s);

/* Enqueues a copy of `bytes` between any two of device / pinned / pageable memory on `s` (the
 * direction is inferred from the addresses). With pageable host memory the call may block the host. */
kvb_status kvb_cuda_copy_async(void *dst, const void *src, size_t bytes, kvb_cuda_stream_t s);

typedef struct kvb_cuda_event kvb_cuda_event;

/* An event; `timing` = 1 lets kvb_cuda_event_elapsed_ms read it (otherwise it is cheaper to record). */
kvb_status kvb_cuda_event_create(int timing, kvb_cuda_event **out);
void kvb_cuda_event_destroy(kvb_cuda_event *e); /* NULL-safe */
/* Marks the point in `s` reached by everything enqueued so far. */
kvb_status kvb_cuda_event_record(kvb_cuda_event *e, kvb_cuda_stream_t s);
/* Makes later work on `s` wait for the event (no host wait): how a compute stream waits for a copy. */
kvb_status kvb_cuda_stream_wait(kvb_cuda_stream_t s, kvb_cuda_event *e);
/* Blocks the host until the event has completed. */
kvb_status kvb_cuda_event_sync(kvb_cuda_event *e);
/* 1 if completed, 0 if not yet; a failure is a KVB_ERR_* (negative). */
int kvb_cuda_event_done(kvb_cuda_event *e);
/* Milliseconds between two completed timing events. */
kvb_status kvb_cuda_event_elapsed_ms(kvb_cuda_event *start, kvb_cuda_event *end, float *ms);

/* ---------------------------------------------------------------- devices and plain memory */

/* Makes `device` current for the calling thread (every call below works on the current device). */
kvb_status kvb_cuda_set_device(int device);
kvb_status kvb_cuda_get_device(int *device);
/* cudaMalloc / cudaFree (NULL-safe; cudaFree waits for the device). */
kvb_status kvb_cuda_malloc(size_t bytes, void **out);
void kvb_cuda_free(void *p);
/* cudaHostAlloc (portable) / cudaFreeHost (NULL-safe): page-locked host memory. */
kvb_status kvb_cuda_host_alloc(size_t bytes, void **out);
void kvb_cuda_host_free(void *p);

/* ---------------------------------------------------------------- virtual memory (driver VMM) */

/* The minimum allocation granularity of pinned device memory on the current device
 * (cuMemGetAllocationGranularity): physical chunks and reservations are multiples of it.
 * KVB_ERR_UNSUPPORTED when the device has no virtual-memory management. */
kvb_status kvb_cuda_vm_granularity(size_t *out);
/* One physical allocation of `bytes` (a multiple of the granularity) on the current device
 * (cuMemCreate); *out is its handle (CUmemGenericAllocationHandle). Uninitialised. */
kvb_status kvb_cuda_phys_create(size_t bytes, uint64_t *out);
/* cuMemRelease: the memory goes once no mapping uses it any more. */
void kvb_cuda_phys_release(uint64_t h);
/* Reserves `bytes` of device address space aligned to `align` (cuMemAddressReserve). */
kvb_status kvb_cuda_va_reserve(size_t bytes, size_t align, void **out);
void kvb_cuda_va_free(void *base, size_t bytes);
/* Maps physical allocation `h` (exactly `bytes` long) at `at` (cuMemMap) and grants the current
 * device read/write access to it (cuMemSetAccess: a mapping is inaccessible until then). */
kvb_status kvb_cuda_va_map(void *at, size_t bytes, uint64_t h);
/* cuMemUnmap of [at, at + bytes): the range stays reserved. The caller synchronised every stream that
 * may still touch it. */
kvb_status kvb_cuda_va_unmap(void *at, size_t bytes);

/* ---------------------------------------------------------------- the memory interface's backend */

struct kvb_mem_i;
/* The `cuda` backend of common/mem/mem.h (mem_cuda.c), for registry.c: the constructor takes the
 * device ordinal (-1: the device current on this thread) and writes back the one it uses; the probe
 * (which makes no context) says whether `device` exists, else why not ("no CUDA device: ..."). */
kvb_status kvb__mem_cuda_create(int *device, const struct kvb_mem_i **iface, void **ctx);
int kvb__mem_cuda_probe(int device, char *why, size_t why_len);

#ifdef __cplusplus
}
#endif

#endif
