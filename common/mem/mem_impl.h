/* kvbank — what a memory backend implements (mem_host.c and the device backends) behind common/mem/mem.h.
 *
 * mem.c checks every argument (sizes, alignment, slot states, double imports), counts and times the
 * virtual-memory calls and keeps the queue of deferred unmaps; a backend only does the work. Only the
 * files of common/mem/ include this header. */
#ifndef KVB_MEM_MEM_IMPL_H
#define KVB_MEM_MEM_IMPL_H

#include "common/mem/mem.h"

typedef struct kvb_mem_i {
    const char *kind;  /* "host" or the device kind */
    int device_memory; /* 1: the host cannot dereference alloc / region / chunk addresses */

    /* Plain memory: `bytes` > 0, 256-byte aligned at least; free is NULL-safe. */
    kvb_status (*alloc)(void *ctx, size_t bytes, void **out);
    void (*free)(void *ctx, void *p);
    /* Pinned host memory: as alloc, host-addressable. */
    kvb_status (*pinned_alloc)(void *ctx, size_t bytes, void **out);
    void (*pinned_free)(void *ctx, void *p);
    /* Synchronous copy between any two addresses of this backend or ordinary host memory. */
    kvb_status (*copy)(void *ctx, void *dst, const void *src, size_t bytes);

    /* Exportable regions. `impl` is the backend's object; `handle` receives the export handle
     * ([KVB_MEM_HANDLE_MAX]). import checks the handle's form and that the region holds exactly
     * `bytes` (KVB_ERR_INVALID otherwise, KVB_ERR_NOT_FOUND when it is gone). region_destroy frees or
     * unmaps. `tag` is checked by mem.c already. */
    kvb_status (*region_create)(void *ctx, const char *tag, size_t bytes, void **impl, void **base, char *handle);
    kvb_status (*region_import)(void *ctx, const char *handle, size_t bytes, void **impl, void **base);
    void (*region_destroy)(void *ctx, void *impl);

    /* Virtual memory. Arguments are checked: sizes and offsets are multiples of the granularity,
     * chunk indices in range, slots in the right state. */
    kvb_status (*granularity)(void *ctx, size_t *out);
    /* `n` chunks of `chunk_bytes`: *impl is the backend's chunk set. */
    kvb_status (*chunks_create)(void *ctx, size_t chunk_bytes, int n, void **impl);
    void (*chunks_destroy)(void *ctx, void *impl);
    /* `bytes` of address space with nothing behind it. */
    kvb_status (*reserve)(void *ctx, size_t bytes, void **base);
    void (*release)(void *ctx, void *base, size_t bytes);
    /* Maps chunk `i` of `chunks` (chunk_bytes long) at `at` read/write; `at` is unmapped reserved space. */
    kvb_status (*map)(void *ctx, void *at, size_t chunk_bytes, void *chunks, int i);
    /* Puts reserved, inaccessible space back at [at, at + bytes), which holds one mapped chunk. */
    kvb_status (*unmap)(void *ctx, void *at, size_t bytes);

    void (*destroy)(void *ctx);
} kvb_mem_i;

/* The host backend's constructor, called by registry.c only (which declares the device backends'). */
kvb_status kvb__mem_host_create(const kvb_mem_i **iface, void **ctx);

/* mem.c: wraps a backend into a kvb_mem (takes ctx; on failure destroys it). */
kvb_status kvb__mem_wrap(const kvb_mem_i *iface, void *ctx, int device, kvb_mem **out);

#endif
