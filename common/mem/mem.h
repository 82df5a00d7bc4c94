/* kvbank — the one memory interface: every byte of KV pool, host tier, stage buffer and activation
 * memory kvbank uses comes from a kvb_mem (docs/engine.md "Memory layer").
 *
 * A kvb_mem is one memory backend on one device, chosen by name in common/mem/registry.c (the only
 * file that knows which backends exist): "host" for the cpu compute backend, a device backend for a
 * device compute backend. It hands out four kinds of memory:
 *
 *  - plain memory the compute backend computes on (kvb_mem_alloc): activations, private KV pools;
 *  - pinned host memory (kvb_mem_pinned_alloc): the host tier and stage buffers, so that copies to and
 *    from the device run asynchronously;
 *  - exportable regions (kvb_mem_region_*): memory another process imports through a handle string
 *    (host: a POSIX shm name; device backends: their IPC handle). A worker's KV pool is one region;
 *    the handle travels worker -> coordinator -> master, never the bytes;
 *  - virtual memory (kvb_mem_chunks_*, kvb_mem_reserve, kvb_mem_map...): physical chunks that are
 *    objects of their own and outlive their mappings, mapped at any chunk-aligned offset of any
 *    reservation, unmapped (the range stays reserved) now or once a fence ticket has passed (eLLM
 *    elastic memory §4.2, §5.1). Every virtual-memory call is counted and timed.
 *
 * Addresses from a device backend are device addresses: only the compute backend and kvb_mem_copy
 * touch them (kvb_mem_is_device). On the host backend every address is an ordinary pointer.
 *
 * Threads: a kvb_mem may be used from several threads at once; one vrange or chunk set must not be
 * changed by two threads at once. Nothing in this header names a device type. */
#ifndef KVB_MEM_MEM_H
#define KVB_MEM_MEM_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/util.h"

typedef struct kvb_mem kvb_mem;

/* ------------------------------------------------------------------------------------- registry */

/* Creates the memory backend for compute backend `backend` ("cpu" or "host": host memory; a device
 * backend's name, with or without its ":variant", picks that device's memory) on device `device`
 * (>= 0; -1: the device current on this thread, device 0 unless the thread chose one). A device backend
 * makes the device current for the calling thread. KVB_ERR_UNSUPPORTED, logged as "no <kind> device:
 * <reason>", when the process sees no such device or fewer than device + 1; KVB_ERR_UNSUPPORTED for a
 * backend without memory in this binary; KVB_ERR_INVALID for a device number the host backend cannot
 * have (anything but -1 and 0). Caller owns the result. */
kvb_status kvb_mem_create(const char *backend, int device, kvb_mem **out);
/* Frees the backend. Everything made from it (allocations, regions, chunks, vranges) must be gone
 * already; a vrange's destruction carries out its deferred unmaps. NULL-safe. */
void kvb_mem_destroy(kvb_mem *m);
/* Whether kvb_mem_create(backend, device) would find its device, without creating anything on it
 * (no device context): 1 yes, 0 no with the reason in why[why_len] (may be NULL). What a supervisor
 * checks before it starts anything. */
int kvb_mem_probe(const char *backend, int device, char *why, size_t why_len);
/* The memory kind of compute backend `backend` ("host", or the device kind), or NULL for a name no
 * memory backend of this binary serves. Two models can share memory only if their kinds are equal. */
const char *kvb_mem_kind_of(const char *backend);
/* Comma-separated kinds compiled into this binary (static string). */
const char *kvb_mem_list(void);

const char *kvb_mem_kind(const kvb_mem *m); /* "host" or the device kind (static string) */
int kvb_mem_device(const kvb_mem *m);       /* device ordinal; 0 for host memory */
int kvb_mem_is_device(const kvb_mem *m);    /* 1 if the host cannot dereference its addresses */

/* -------------------------------------------------------------------------- plain and pinned memory */

/* `bytes` (> 0) of uninitialised memory the compute backend of this kind reads and writes, aligned to
 * at least 256 bytes. Caller owns it: kvb_mem_free (NULL-safe). KVB_ERR_NOMEM when full. */
kvb_status kvb_mem_alloc(kvb_mem *m, size_t bytes, void **out);
void kvb_mem_free(kvb_mem *m, void *p);
/* `bytes` (> 0) of uninitialised page-locked host memory (host backend: page-aligned host memory), which
 * the host reads and writes directly and a device copies to and from asynchronously. */
kvb_status kvb_mem_pinned_alloc(kvb_mem *m, size_t bytes, void **out);
void kvb_mem_pinned_free(kvb_mem *m, void *p);
/* Copies `bytes` between any two addresses of this backend (plain, pinned, region, mapped chunk) or
 * ordinary host memory; returns when the bytes are in place. Not for the token path. */
kvb_status kvb_mem_copy(kvb_mem *m, void *dst, const void *src, size_t bytes);

/* ---------------------------------------------------------------------------- exportable regions */

typedef struct kvb_mem_region kvb_mem_region;

/* Longest handle string of any backend, terminator included. */
#define KVB_MEM_HANDLE_MAX 160

/* Creates a zero-filled region of `bytes` (> 0) that another process imports with its handle.
 * `tag` (1..40 of [A-Za-z0-9_-]) names the region where the backend has names (host: the shm object
 * "/kvb-<tag>-<pid>-<seq>", so a supervisor can remove stale ones). Caller owns the result. */
kvb_status kvb_mem_region_create(kvb_mem *m, const char *tag, size_t bytes, kvb_mem_region **out);
/* Maps the region exported by another process (host: or this one) as `handle`, announced to hold
 * `bytes`. KVB_ERR_INVALID for a malformed handle or when the region's size is not `bytes`;
 * KVB_ERR_NOT_FOUND when no such region exists (its exporter freed it or died); KVB_ERR_STATE when this
 * kvb_mem has imported the same handle already and not destroyed it (a double import). Destroying the
 * result unmaps; the exporter's memory lives on until the exporter frees it. Caller owns the result. */
kvb_status kvb_mem_region_import(kvb_mem *m, const char *handle, size_t bytes, kvb_mem_region **out);
/* Frees (creator) or unmaps (importer). No kernel may still read it. NULL-safe. */
void kvb_mem_region_destroy(kvb_mem_region *r);

void *kvb_mem_region_base(const kvb_mem_region *r);
size_t kvb_mem_region_size(const kvb_mem_region *r);
const char *kvb_mem_region_handle(const kvb_mem_region *r); /* owned by the region */
int kvb_mem_region_is_owner(const kvb_mem_region *r);

/* ------------------------------------------------------------------------------- virtual memory */

/* The granularity of this backend's virtual memory in bytes (host: the page size; a device: its
 * minimum allocation granularity, usually 2 MiB): chunk sizes and reservations are multiples of it. */
kvb_status kvb_mem_granularity(kvb_mem *m, size_t *out);

typedef struct kvb_mem_chunks kvb_mem_chunks;

/* Creates `n` (> 0) physical chunks of `chunk_bytes` each (a multiple of the granularity, else
 * KVB_ERR_INVALID), all up front: host: ranges of one memfd reserved with fallocate (a full machine
 * fails here, not with SIGBUS mid-step; refused when n would exceed half of vm.max_map_count); a
 * device: one physical allocation per chunk. Contents are uninitialised. A chunk is a handle of its
 * own: it keeps its bytes while unmapped and may be mapped at several addresses at once.
 * Caller owns the result. */
kvb_status kvb_mem_chunks_create(kvb_mem *m, size_t chunk_bytes, int n, kvb_mem_chunks **out);
/* Releases the chunks. Every mapping of them must be gone (deferred unmaps included): KVB_ERR_STATE
 * is logged and the chunks are kept otherwise. NULL-safe. */
void kvb_mem_chunks_destroy(kvb_mem_chunks *c);
size_t kvb_mem_chunks_bytes(const kvb_mem_chunks *c);
int kvb_mem_chunks_count(const kvb_mem_chunks *c);
/* Mappings of chunk i now (a pending deferred unmap still counts). */
int kvb_mem_chunk_mappings(const kvb_mem_chunks *c, int i);

typedef struct kvb_mem_vrange kvb_mem_vrange;

/* Reserves `bytes` of address space with nothing behind it, in slots of `chunk_bytes` (`bytes` a
 * positive multiple of `chunk_bytes`, itself a multiple of the granularity; else KVB_ERR_INVALID).
 * Touching an unmapped slot faults. Caller owns the result. */
kvb_status kvb_mem_reserve(kvb_mem *m, size_t bytes, size_t chunk_bytes, kvb_mem_vrange **out);
/* Unmaps every slot (waiting for the fences of pending deferred unmaps) and frees the range.
 * NULL-safe. */
void kvb_mem_vrange_destroy(kvb_mem_vrange *v);
void *kvb_mem_vrange_base(const kvb_mem_vrange *v);
size_t kvb_mem_vrange_size(const kvb_mem_vrange *v);
size_t kvb_mem_vrange_chunk_bytes(const kvb_mem_vrange *v);

/* Maps chunk `i` of `c` at byte `offset` of `v`, read/write for this backend's device. KVB_ERR_INVALID
 * when offset is not a multiple of v's chunk size or lies outside it, when c's chunk size differs
 * from v's, or when c and v belong to different kvb_mem; KVB_ERR_STATE when the slot is mapped (or its
 * deferred unmap is pending). */
kvb_status kvb_mem_map(kvb_mem_vrange *v, size_t offset, kvb_mem_chunks *c, int i);
/* Unmaps the slot at `offset` now; the range stays reserved (host: PROT_NONE anonymous memory is
 * mapped back over it, never munmap). The caller guarantees nothing may still read it. KVB_ERR_STATE
 * when the slot is not mapped or its deferred unmap is pending. */
kvb_status kvb_mem_unmap(kvb_mem_vrange *v, size_t offset);

/* Something that hands out tickets for work in flight (the stager, a thread pool, a device stream)
 * and says when the work behind a ticket has finished. Borrowed by kvb_mem_unmap_after until the
 * unmap has happened. */
typedef struct kvb_mem_fence {
    void *ud;
    /* 1 once every piece of work issued before `ticket` was handed out has finished, else 0. */
    int (*passed)(void *ud, uint64_t ticket);
    /* Blocks until passed(ticket) would be 1. May be NULL: waiting then polls passed(). */
    kvb_status (*wait)(void *ud, uint64_t ticket);
} kvb_mem_fence;

/* Unmaps the slot at `offset` once `ticket` of `f` has passed: at once if it has, else queued and
 * carried out by a later kvb_mem_collect (the slot stays mapped and counted until then, so nothing can
 * be mapped over memory a kernel may still read). Errors as kvb_mem_unmap. */
kvb_status kvb_mem_unmap_after(kvb_mem_vrange *v, size_t offset, const kvb_mem_fence *f, uint64_t ticket);
/* Carries out the queued unmaps of `m` whose tickets have passed (wait = 1: waits for all of them).
 * *n_done (may be NULL) gets how many were unmapped. Returns the first error of an unmap (the others
 * still run). */
kvb_status kvb_mem_collect(kvb_mem *m, int wait, int *n_done);
/* Unmaps queued behind fences not yet passed. */
int kvb_mem_pending(const kvb_mem *m);
/* What is mapped at `offset` of `v`: 1 with *c and *i set (*pending: a deferred unmap is queued), 0
 * for an unmapped slot, KVB_ERR_INVALID for a bad offset. Pointers may be NULL. */
int kvb_mem_mapped_at(const kvb_mem_vrange *v, size_t offset, kvb_mem_chunks **c, int *i, int *pending);

/* Counters and timers of the virtual-memory calls of one kvb_mem (eLLM §6.5 reports their share of
 * the execution time). */
typedef enum kvb_mem_op {
    KVB_MEM_OP_RESERVE = 0,  /* kvb_mem_reserve */
    KVB_MEM_OP_RELEASE,      /* freeing a reservation */
    KVB_MEM_OP_CREATE,       /* creating physical chunks (one call per chunk set) */
    KVB_MEM_OP_DESTROY,      /* releasing physical chunks */
    KVB_MEM_OP_MAP,          /* one chunk mapped */
    KVB_MEM_OP_UNMAP,        /* one chunk unmapped (now, or deferred once its ticket passed) */
    KVB_MEM_OP_N,
} kvb_mem_op;

typedef struct kvb_mem_vm_stats {
    uint64_t calls[KVB_MEM_OP_N]; /* calls that reached the backend (refused arguments are not counted) */
    uint64_t ns[KVB_MEM_OP_N];    /* wall time spent in them */
    uint64_t deferred;            /* unmaps that were queued behind a fence */
} kvb_mem_vm_stats;

void kvb_mem_vm_stats_get(const kvb_mem *m, kvb_mem_vm_stats *out);
const char *kvb_mem_op_name(kvb_mem_op op);

/* ---------------------------------------------------------------------- allocators (activations) */

/* Where the forward pass gets each step's buffers: it asks for them at the start of a step, sized by
 * that step's tokens, and gives them back at its end. The caller of the forward pass supplies it (the
 * eLLM elastic planner: its activation pool; everyone else: a step arena). */
typedef struct kvb_mem_allocator_i {
    /* `bytes` (> 0) of memory the compute backend computes on, uninitialised, 256-byte aligned. */
    kvb_status (*alloc)(void *ctx, size_t bytes, void **out);
    /* Gives `p` (NULL-safe) back. Work already issued on the compute stream may still read it: an
     * allocator that hands it to anything but the same stream, or unmaps it, waits for a fence. */
    void (*free)(void *ctx, void *p);
} kvb_mem_allocator_i;

typedef struct kvb_mem_allocator {
    const kvb_mem_allocator_i *iface;
    void *ctx;
} kvb_mem_allocator;

/* A step arena: one block of kvb_mem_alloc memory handed out front to back; when every buffer of it
 * has been given back it starts again at the front, and when a step needed more than it holds, the
 * next start replaces it by one that holds that much (buffers that did not fit came from kvb_mem_alloc
 * meanwhile). Steady steps therefore allocate nothing. Borrows `m`. Caller owns the result. */
typedef struct kvb_mem_arena kvb_mem_arena;
kvb_status kvb_mem_arena_create(kvb_mem *m, kvb_mem_arena **out);
void kvb_mem_arena_destroy(kvb_mem_arena *a); /* every buffer must have been given back; NULL-safe */
kvb_mem_allocator kvb_mem_arena_allocator(kvb_mem_arena *a);
size_t kvb_mem_arena_capacity(const kvb_mem_arena *a); /* bytes of its block now */
uint64_t kvb_mem_arena_grows(const kvb_mem_arena *a);  /* times the block was replaced by a larger one */

#endif
