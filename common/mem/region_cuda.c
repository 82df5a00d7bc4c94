/* kvbank — CUDA device memory: regions with IPC handles, pinned buffers, streams, events, and
 * virtual-memory regions (see region_cuda.h). */
#include "common/mem/region_cuda.h"

#include <cuda.h> /* driver API types only: the functions are reached through entry points */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- errors */

kvb_status kvb__cuda_status(int err, const char *expr, const char *file, int line) {
    if (err == (int)cudaSuccess) return KVB_OK;
    cudaError_t e = (cudaError_t)err;
    KVB_LOG_E("cuda: %s: %s (%s) at %s:%d", expr, cudaGetErrorString(e), cudaGetErrorName(e), file, line);
    switch (e) {
    case cudaErrorMemoryAllocation: return KVB_ERR_NOMEM;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNotSupported: return KVB_ERR_UNSUPPORTED;
    default: return KVB_ERR_BACKEND;
    }
}

/* ---------------------------------------------------------------- driver entry points */

typedef CUresult (*pfn_cuGetErrorString)(CUresult, const char **);
typedef CUresult (*pfn_cuDeviceGet)(CUdevice *, int);
typedef CUresult (*pfn_cuDeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
typedef CUresult (*pfn_cuMemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
typedef CUresult (*pfn_cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *,
                                                      CUmemAllocationGranularity_flags);
typedef CUresult (*pfn_cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*pfn_cuMemAddressFree)(CUdeviceptr, size_t);
typedef CUresult (*pfn_cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                    unsigned long long);
typedef CUresult (*pfn_cuMemRelease)(CUmemGenericAllocationHandle);
typedef CUresult (*pfn_cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*pfn_cuMemUnmap)(CUdeviceptr, size_t);
typedef CUresult (*pfn_cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);

/* The driver functions kvbank uses, resolved once per process. `ok` is 0 when the runtime could not
 * resolve them (no driver): every user checks drv_get() first. */
static struct {
    int ok;
    pfn_cuGetErrorString GetErrorString;
    pfn_cuDeviceGet DeviceGet;
    pfn_cuDeviceGetAttribute DeviceGetAttribute;
    pfn_cuMemGetAddressRange MemGetAddressRange;
    pfn_cuMemGetAllocationGranularity MemGetAllocationGranularity;
    pfn_cuMemAddressReserve MemAddressReserve;
    pfn_cuMemAddressFree MemAddressFree;
    pfn_cuMemCreate MemCreate;
    pfn_cuMemRelease MemRelease;
    pfn_cuMemMap MemMap;
    pfn_cuMemUnmap MemUnmap;
    pfn_cuMemSetAccess MemSetAccess;
} g_drv;
static pthread_once_t g_drv_once = PTHREAD_ONCE_INIT;

/* The driver ABI version these prototypes follow (CUDA 12.0: cuMemGetAddressRange is the _v2 one). */
#define DRV_ABI_VERSION 12000

static int resolve(const char *sym, void **fn) {
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion(sym, fn, DRV_ABI_VERSION, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !*fn) {
        (void)cudaGetLastError();
        *fn = NULL;
        return 0;
    }
    return 1;
}

static void drv_init(void) {
    int ok = 1;
    ok &= resolve("cuGetErrorString", (void **)&g_drv.GetErrorString);
    ok &= resolve("cuDeviceGet", (void **)&g_drv.DeviceGet);
    ok &= resolve("cuDeviceGetAttribute", (void **)&g_drv.DeviceGetAttribute);
    ok &= resolve("cuMemGetAddressRange", (void **)&g_drv.MemGetAddressRange);
    ok &= resolve("cuMemGetAllocationGranularity", (void **)&g_drv.MemGetAllocationGranularity);
    ok &= resolve("cuMemAddressReserve", (void **)&g_drv.MemAddressReserve);
    ok &= resolve("cuMemAddressFree", (void **)&g_drv.MemAddressFree);
    ok &= resolve("cuMemCreate", (void **)&g_drv.MemCreate);
    ok &= resolve("cuMemRelease", (void **)&g_drv.MemRelease);
    ok &= resolve("cuMemMap", (void **)&g_drv.MemMap);
    ok &= resolve("cuMemUnmap", (void **)&g_drv.MemUnmap);
    ok &= resolve("cuMemSetAccess", (void **)&g_drv.MemSetAccess);
    g_drv.ok = ok;
}

/* The driver table, or KVB_ERR_UNSUPPORTED (logged) when it cannot be reached. Initialises the
 * runtime (and with it the primary context of the current device) first. */
static kvb_status drv_get(void) {
    KVB_TRY(KVB_CUDA_CHECK(cudaFree(NULL)));
    pthread_once(&g_drv_once, drv_init);
    if (!g_drv.ok) {
        KVB_LOG_E("cuda: the driver API entry points (cuMem*) could not be resolved");
        return KVB_ERR_UNSUPPORTED;
    }
    return KVB_OK;
}

kvb_status kvb__cu_status(int res, const char *expr, const char *file, int line) {
    if (res == (int)CUDA_SUCCESS) return KVB_OK;
    const char *msg = NULL;
    if (g_drv.GetErrorString) g_drv.GetErrorString((CUresult)res, &msg);
    KVB_LOG_E("cuda driver: %s: %s (CUresult %d) at %s:%d", expr, msg ? msg : "unknown error", res, file, line);
    switch ((CUresult)res) {
    case CUDA_ERROR_OUT_OF_MEMORY: return KVB_ERR_NOMEM;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_SUPPORTED: return KVB_ERR_UNSUPPORTED;
    default: return KVB_ERR_BACKEND;
    }
}

kvb_status kvb_cuda_device_count(int *n, char *why, size_t why_len) {
    int c = 0;
    cudaError_t e = cudaGetDeviceCount(&c);
    if (e != cudaSuccess) {
        if (why && why_len) snprintf(why, why_len, "%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        (void)cudaGetLastError();
        c = 0;
    } else if (c == 0 && why && why_len) {
        snprintf(why, why_len, "the runtime reports 0 devices");
    } else if (why && why_len) {
        why[0] = 0;
    }
    *n = c;
    return KVB_OK;
}

/* Runs `cudaMemsetAsync(p, 0, bytes)` on a private non-blocking stream and waits for it. */
static kvb_status zero_fill(void *p, size_t bytes) {
    cudaStream_t s = NULL;
    KVB_TRY(KVB_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)));
    kvb_status st = KVB_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, s));
    if (st == KVB_OK) st = KVB_CUDA_CHECK(cudaStreamSynchronize(s));
    cudaStreamDestroy(s);
    return st;
}

/* ---------------------------------------------------------------- device regions */

struct kvb_cuda_region {
    void *base;                          /* [size] bytes of device memory */
    size_t size;                         /* bytes */
    int owner;                           /* 1: cudaMalloc'd here (cudaFree); 0: imported (close) */
    char handle[KVB_CUDA_HANDLE_MAX];    /* the cudaIpcMemHandle_t as hex */
};

int kvb_cuda_handle_valid(const char *s) {
    if (!s) return 0;
    for (int i = 0; i < KVB_CUDA_HANDLE_CHARS; i++) {
        char ch = s[i];
        if (!((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F'))) return 0;
    }
    return s[KVB_CUDA_HANDLE_CHARS] == 0;
}

static void to_hex(const unsigned char *b, size_t n, char *out) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    out[2 * n] = 0;
}

static int hex_val(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    return ch - 'A' + 10;
}

kvb_status kvb_cuda_region_create(size_t bytes, kvb_cuda_region **out) {
    _Static_assert(sizeof(cudaIpcMemHandle_t) * 2 == KVB_CUDA_HANDLE_CHARS, "IPC handle size");
    if (bytes == 0) return KVB_ERR_INVALID;
    kvb_cuda_region *r = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *r, (void **)&r));
    kvb_status st;
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaMalloc(&r->base, bytes)), fail_struct);
    r->size = bytes;
    r->owner = 1;
    KVB_TRY_GOTO(zero_fill(r->base, bytes), fail_mem);
    cudaIpcMemHandle_t h;
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaIpcGetMemHandle(&h, r->base)), fail_mem);
    to_hex((const unsigned char *)&h, sizeof h, r->handle);
    *out = r;
    return KVB_OK;
fail_mem:
    cudaFree(r->base);
fail_struct:
    free(r);
    return st;
}

kvb_status kvb_cuda_region_import(const char *handle, size_t bytes, kvb_cuda_region **out) {
    if (!kvb_cuda_handle_valid(handle)) {
        KVB_LOG_E("cuda region: a handle is %d hex digits", KVB_CUDA_HANDLE_CHARS);
        return KVB_ERR_INVALID;
    }
    if (bytes == 0) return KVB_ERR_INVALID;
    KVB_TRY(drv_get());
    cudaIpcMemHandle_t h;
    unsigned char *hb = (unsigned char *)&h;
    for (size_t i = 0; i < sizeof h; i++) hb[i] = (unsigned char)(hex_val(handle[2 * i]) << 4 | hex_val(handle[2 * i + 1]));
    kvb_cuda_region *r = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *r, (void **)&r));
    kvb_status st;
    cudaError_t e = cudaIpcOpenMemHandle(&r->base, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        /* a handle of this very process, of a freed allocation, or of a dead process */
        KVB_LOG_E("cuda region: cannot open IPC handle %.16s...: %s (%s)", handle, cudaGetErrorString(e),
                  cudaGetErrorName(e));
        (void)cudaGetLastError();
        free(r);
        return e == cudaErrorMemoryAllocation ? KVB_ERR_NOMEM : KVB_ERR_INVALID;
    }
    CUdeviceptr rb = 0;
    size_t rs = 0;
    CUresult q = g_drv.MemGetAddressRange(&rb, &rs, (CUdeviceptr)(uintptr_t)r->base);
    if (q != CUDA_SUCCESS) {
        /* the mapping is usable; only the size check is lost */
        KVB_LOG_W("cuda region: cannot read the imported allocation's size (CUresult %d); trusting %zu bytes", (int)q,
                  bytes);
    } else if ((void *)(uintptr_t)rb != r->base || rs < bytes) {
        KVB_LOG_E("cuda region: the imported allocation holds %zu bytes, the exporter announced %zu", rs, bytes);
        st = KVB_ERR_INVALID;
        goto fail_open;
    }
    r->size = bytes;
    r->owner = 0;
    memcpy(r->handle, handle, KVB_CUDA_HANDLE_CHARS);
    for (int i = 0; i < KVB_CUDA_HANDLE_CHARS; i++)
        if (r->handle[i] >= 'A' && r->handle[i] <= 'F') r->handle[i] = (char)(r->handle[i] - 'A' + 'a');
    r->handle[KVB_CUDA_HANDLE_CHARS] = 0;
    *out = r;
    return KVB_OK;
fail_open:
    cudaIpcCloseMemHandle(r->base);
    free(r);
    return st;
}

void kvb_cuda_region_destroy(kvb_cuda_region *r) {
    if (!r) return;
    /* no kernel of this process may still read or write the memory */
    (void)KVB_CUDA_CHECK(cudaDeviceSynchronize());
    if (r->owner) (void)KVB_CUDA_CHECK(cudaFree(r->base));
    else (void)KVB_CUDA_CHECK(cudaIpcCloseMemHandle(r->base));
    free(r);
}

void *kvb_cuda_region_base(const kvb_cuda_region *r) { return r->base; }
size_t kvb_cuda_region_size(const kvb_cuda_region *r) { return r->size; }
const char *kvb_cuda_region_handle(const kvb_cuda_region *r) { return r->handle; }
int kvb_cuda_region_is_owner(const kvb_cuda_region *r) { return r->owner; }

/* ---------------------------------------------------------------- pinned host buffers */

struct kvb_cuda_pinned {
    void *base; /* [size] bytes of page-locked host memory */
    size_t size;
};

kvb_status kvb_cuda_pinned_create(size_t bytes, kvb_cuda_pinned **out) {
    if (bytes == 0) return KVB_ERR_INVALID;
    kvb_cuda_pinned *p = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *p, (void **)&p));
    kvb_status st = KVB_CUDA_CHECK(cudaHostAlloc(&p->base, bytes, cudaHostAllocPortable));
    if (st != KVB_OK) {
        free(p);
        return st;
    }
    p->size = bytes;
    *out = p;
    return KVB_OK;
}

void kvb_cuda_pinned_destroy(kvb_cuda_pinned *p) {
    if (!p) return;
    (void)KVB_CUDA_CHECK(cudaFreeHost(p->base));
    free(p);
}

void *kvb_cuda_pinned_base(const kvb_cuda_pinned *p) { return p->base; }
size_t kvb_cuda_pinned_size(const kvb_cuda_pinned *p) { return p->size; }

/* ---------------------------------------------------------------- streams, copies, events */

kvb_status kvb_cuda_stream_create(kvb_cuda_stream_t *out) {
    cudaStream_t s = NULL;
    KVB_TRY(KVB_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)));
    *out = s;
    return KVB_OK;
}

void kvb_cuda_stream_destroy(kvb_cuda_stream_t s) {
    if (!s) return;
    (void)KVB_CUDA_CHECK(cudaStreamSynchronize(s));
    (void)KVB_CUDA_CHECK(cudaStreamDestroy(s));
}

kvb_status kvb_cuda_stream_sync(kvb_cuda_stream_t s) { return KVB_CUDA_CHECK(cudaStreamSynchronize(s)); }

kvb_status kvb_cuda_copy_async(void *dst, const void *src, size_t bytes, kvb_cuda_stream_t s) {
    if (bytes == 0) return KVB_OK;
    return KVB_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
}

struct kvb_cuda_event {
    cudaEvent_t ev;
};

kvb_status kvb_cuda_event_create(int timing, kvb_cuda_event **out) {
    kvb_cuda_event *e = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *e, (void **)&e));
    kvb_status st = KVB_CUDA_CHECK(cudaEventCreateWithFlags(&e->ev, timing ? cudaEventDefault : cudaEventDisableTiming));
    if (st != KVB_OK) {
        free(e);
        return st;
    }
    *out = e;
    return KVB_OK;
}

void kvb_cuda_event_destroy(kvb_cuda_event *e) {
    if (!e) return;
    (void)KVB_CUDA_CHECK(cudaEventDestroy(e->ev));
    free(e);
}

kvb_status kvb_cuda_event_record(kvb_cuda_event *e, kvb_cuda_stream_t s) {
    return KVB_CUDA_CHECK(cudaEventRecord(e->ev, s));
}

kvb_status kvb_cuda_stream_wait(kvb_cuda_stream_t s, kvb_cuda_event *e) {
    return KVB_CUDA_CHECK(cudaStreamWaitEvent(s, e->ev, 0));
}

kvb_status kvb_cuda_event_sync(kvb_cuda_event *e) { return KVB_CUDA_CHECK(cudaEventSynchronize(e->ev)); }

int kvb_cuda_event_done(kvb_cuda_event *e) {
    cudaError_t r = cudaEventQuery(e->ev);
    if (r == cudaSuccess) return 1;
    if (r == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return 0;
    }
    return (int)KVB_CUDA_CHECK(r);
}

kvb_status kvb_cuda_event_elapsed_ms(kvb_cuda_event *start, kvb_cuda_event *end, float *ms) {
    return KVB_CUDA_CHECK(cudaEventElapsedTime(ms, start->ev, end->ev));
}

/* ---------------------------------------------------------------- devices and plain memory */

kvb_status kvb_cuda_set_device(int device) { return KVB_CUDA_CHECK(cudaSetDevice(device)); }
kvb_status kvb_cuda_get_device(int *device) { return KVB_CUDA_CHECK(cudaGetDevice(device)); }

kvb_status kvb_cuda_malloc(size_t bytes, void **out) { return KVB_CUDA_CHECK(cudaMalloc(out, bytes)); }

void kvb_cuda_free(void *p) {
    if (!p) return;
    /* no kernel of this process may still read or write it (cudaFree would wait too; say it) */
    (void)KVB_CUDA_CHECK(cudaDeviceSynchronize());
    (void)KVB_CUDA_CHECK(cudaFree(p));
}

kvb_status kvb_cuda_host_alloc(size_t bytes, void **out) {
    return KVB_CUDA_CHECK(cudaHostAlloc(out, bytes, cudaHostAllocPortable));
}

void kvb_cuda_host_free(void *p) {
    if (p) (void)KVB_CUDA_CHECK(cudaFreeHost(p));
}

/* ---------------------------------------------------------------- virtual memory (driver VMM) */

#define VM_DEVICES 64
/* Per device ordinal: 1 once checked for virtual-memory support (its CUdevice in g_vm_dev). */
static int g_vm_known[VM_DEVICES];
static CUdevice g_vm_dev[VM_DEVICES];
static pthread_mutex_t g_vm_mu = PTHREAD_MUTEX_INITIALIZER;

/* Pinned device memory on the current device (checked for virtual-memory support once per device). */
static kvb_status vm_prop(CUmemAllocationProp *prop) {
    KVB_TRY(drv_get());
    int ordinal = 0;
    KVB_TRY(KVB_CUDA_CHECK(cudaGetDevice(&ordinal)));
    if (ordinal < 0 || ordinal >= VM_DEVICES) return KVB_ERR_UNSUPPORTED;
    pthread_mutex_lock(&g_vm_mu);
    kvb_status st = KVB_OK;
    if (!g_vm_known[ordinal]) {
        CUdevice dev = 0;
        int vmm_ok = 0;
        st = KVB_CUDA_DRV_CHECK(g_drv.DeviceGet(&dev, ordinal));
        if (st == KVB_OK)
            st = KVB_CUDA_DRV_CHECK(
                g_drv.DeviceGetAttribute(&vmm_ok, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
        if (st == KVB_OK && !vmm_ok) {
            KVB_LOG_E("cuda vmm: device %d does not support virtual memory management", ordinal);
            st = KVB_ERR_UNSUPPORTED;
        }
        if (st == KVB_OK) {
            g_vm_dev[ordinal] = dev;
            g_vm_known[ordinal] = 1;
        }
    }
    CUdevice dev = g_vm_dev[ordinal];
    pthread_mutex_unlock(&g_vm_mu);
    KVB_TRY(st);
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = dev;
    return KVB_OK;
}

kvb_status kvb_cuda_vm_granularity(size_t *out) {
    CUmemAllocationProp prop;
    KVB_TRY(vm_prop(&prop));
    size_t g = 0;
    KVB_TRY(KVB_CUDA_DRV_CHECK(g_drv.MemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)));
    *out = g ? g : (size_t)2 << 20;
    return KVB_OK;
}

kvb_status kvb_cuda_phys_create(size_t bytes, uint64_t *out) {
    CUmemAllocationProp prop;
    KVB_TRY(vm_prop(&prop));
    CUmemGenericAllocationHandle h = 0;
    KVB_TRY(KVB_CUDA_DRV_CHECK(g_drv.MemCreate(&h, bytes, &prop, 0)));
    *out = (uint64_t)h;
    return KVB_OK;
}

void kvb_cuda_phys_release(uint64_t h) {
    if (g_drv.ok) (void)KVB_CUDA_DRV_CHECK(g_drv.MemRelease((CUmemGenericAllocationHandle)h));
}

kvb_status kvb_cuda_va_reserve(size_t bytes, size_t align, void **out) {
    KVB_TRY(drv_get());
    CUdeviceptr p = 0;
    KVB_TRY(KVB_CUDA_DRV_CHECK(g_drv.MemAddressReserve(&p, bytes, align, 0, 0)));
    *out = (void *)(uintptr_t)p;
    return KVB_OK;
}

void kvb_cuda_va_free(void *base, size_t bytes) {
    if (g_drv.ok) (void)KVB_CUDA_DRV_CHECK(g_drv.MemAddressFree((CUdeviceptr)(uintptr_t)base, bytes));
}

kvb_status kvb_cuda_va_map(void *at, size_t bytes, uint64_t h) {
    CUmemAllocationProp prop;
    KVB_TRY(vm_prop(&prop));
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)at;
    KVB_TRY(KVB_CUDA_DRV_CHECK(g_drv.MemMap(p, bytes, 0, (CUmemGenericAllocationHandle)h, 0)));
    CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    kvb_status st = KVB_CUDA_DRV_CHECK(g_drv.MemSetAccess(p, bytes, &acc, 1));
    if (st != KVB_OK) (void)KVB_CUDA_DRV_CHECK(g_drv.MemUnmap(p, bytes));
    return st;
}

kvb_status kvb_cuda_va_unmap(void *at, size_t bytes) {
    KVB_TRY(drv_get());
    return KVB_CUDA_DRV_CHECK(g_drv.MemUnmap((CUdeviceptr)(uintptr_t)at, bytes));
}
