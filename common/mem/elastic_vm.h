/* kvbank — the virtual-memory calls of the unified chunk pool (elastic_pool.h, kvb_vm_ops) carried out
 * on a kvb_mem (mem.h): P_T physical chunks created up front as one chunk set, one reservation (vrange)
 * per pool reservation, every call counted and timed by mem.h.
 *
 * Overlapping the calls (ellm-elastic-memory.txt §5.1) with a mapper thread:
 *  - asynchronous unmapping: every unmap is queued to the mapper thread, which unmaps once the fence
 *    ticket current at the call has passed (kvb_mem_unmap_after); the chunk itself may be mapped
 *    elsewhere at once (one chunk at two addresses);
 *  - speculative pre-mapping: between kvb_elastic_vm_async(vm, 1) and (vm, 0) maps are queued too, so
 *    they run while the step computes.
 * A map made on the caller's thread (synchronous: on the critical path, counted as such) first waits
 * for queued calls on its reservation, so the calls on one place keep their order. A map onto a place
 * whose deferred unmap still waits for its fence waits for that fence.
 *
 * Threads: the caller's thread (one planner) makes the calls; the mapper thread only carries them out. */
#ifndef KVB_MEM_ELASTIC_VM_H
#define KVB_MEM_ELASTIC_VM_H

#include <stdint.h>

#include "common/mem/elastic_pool.h"
#include "common/mem/mem.h"

typedef struct kvb_elastic_vm kvb_elastic_vm;

/* Creates `n_chunks` chunks of `chunk_bytes` on `m` (borrowed; chunk_bytes a multiple of its
 * granularity) and, with `mapper` = 1, starts the mapper thread (0: every call is synchronous).
 * Caller owns the result. */
kvb_status kvb_elastic_vm_create(kvb_mem *m, size_t chunk_bytes, int n_chunks, int mapper, kvb_elastic_vm **out);
/* Waits for the mapper, stops it and frees the chunks: every reservation must have been released (the
 * pool's destroy does it). NULL-safe. */
void kvb_elastic_vm_destroy(kvb_elastic_vm *vm);
/* The calls, for kvb_epool_create (the ctx is vm). */
kvb_vm_ops kvb_elastic_vm_ops(kvb_elastic_vm *vm);

/* The fence unmaps wait behind (borrowed; NULL: unmap as soon as the mapper gets to it), and the ticket
 * of the work issued so far: a place unmapped now is unmapped once `ticket` has passed. */
void kvb_elastic_vm_set_fence(kvb_elastic_vm *vm, const kvb_mem_fence *f);
void kvb_elastic_vm_set_ticket(kvb_elastic_vm *vm, uint64_t ticket);
/* 1: maps are queued to the mapper thread too (speculative pre-mapping); 0: synchronous again. No-op
 * without a mapper. */
void kvb_elastic_vm_async(kvb_elastic_vm *vm, int on);
/* Waits until the mapper has carried out every queued call. Returns the first error of a queued call
 * since the last drain (the pool's books then no longer match the mappings: the caller fails). */
kvb_status kvb_elastic_vm_drain(kvb_elastic_vm *vm);

/* The address of byte `offset` of reservation `res` (what reserve returned as its base + offset). */
void *kvb_elastic_vm_addr(const kvb_elastic_vm *vm, int32_t res, size_t offset);
kvb_mem *kvb_elastic_vm_mem(const kvb_elastic_vm *vm);

typedef struct kvb_elastic_vm_stats {
    uint64_t sync_maps;       /* maps on the caller's thread (the critical path) */
    uint64_t async_maps;      /* maps on the mapper thread (pre-mapping) */
    uint64_t async_unmaps;    /* unmaps on the mapper thread */
    uint64_t sync_unmaps;     /* unmaps on the caller's thread (no mapper) */
    uint64_t sync_ns;         /* time in map/unmap calls on the caller's thread */
    uint64_t async_ns;        /* time in map/unmap calls on the mapper thread */
    uint64_t drain_waits;     /* synchronous calls that had to wait for the mapper */
    uint64_t drain_wait_ns;   /* time they waited */
    uint64_t fence_waits;     /* maps that waited for a deferred unmap's fence */
} kvb_elastic_vm_stats;
void kvb_elastic_vm_get_stats(const kvb_elastic_vm *vm, kvb_elastic_vm_stats *out);

#endif
