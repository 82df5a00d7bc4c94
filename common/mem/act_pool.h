/* kvbank — the activation eTensor pool of eLLM (ellm-elastic-memory.txt §4.2.2, §4.3.1 ❷): a
 * best-fit-with-coalescing allocator (BFC, as PyTorch's caching allocator, which eLLM keeps) whose
 * segments are chunk-aligned reservations of the unified pool (common/mem/elastic_pool.h), with
 * physical chunks mapped only where live blocks land.
 *
 * Blocks are carved from a segment's free blocks (best fit: the smallest free block that holds the
 * request; ties go to the one that needs fewer new chunks, then to the lowest address); a freed block
 * merges with free neighbours. A chunk of a segment is *live* while a live block overlaps it; a
 * mapped chunk with no live block is *idle*: it stays mapped (the pool's cache, so a steady stream of
 * same-sized steps makes no virtual-memory call) until garbage collection unmaps it for the KV cache
 * (inflation) or the pool itself needs it at another place. Only idle or unmapped chunks can leave the
 * pool. The first segment is reserved large (address space only); a request that no free block can
 * hold opens a segment of its own, which garbage collection releases once it is empty.
 *
 * Not thread-safe (the executor of one model calls it between and during steps). */
#ifndef KVB_MEM_ACT_POOL_H
#define KVB_MEM_ACT_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "common/mem/elastic_pool.h"

typedef struct kvb_act_pool kvb_act_pool;

/* Creates the pool over `ep` (borrowed for the pool's lifetime). The first segment reserves
 * `seg_chunks` (>= 1) chunks of address space. Blocks are `align`-aligned (a power of two that divides
 * the chunk size). Caller owns the result. */
kvb_status kvb_act_pool_create(kvb_epool *ep, int seg_chunks, size_t align, kvb_act_pool **out);
/* Releases every segment (their chunks go back to the activations' free list). NULL-safe. */
void kvb_act_pool_destroy(kvb_act_pool *a);

/* A block of at least `bytes` (> 0) bytes at *addr (an address of the segment's reservation). The
 * chunks it covers are mapped first: from the activations' free chunks, else by moving an idle chunk
 * of the pool from elsewhere. KVB_ERR_EXHAUSTED (nothing allocated) if neither has one left. */
kvb_status kvb_act_pool_alloc(kvb_act_pool *a, size_t bytes, uintptr_t *addr);
/* Frees the block at `addr`; KVB_ERR_INVALID (logged, nothing changed) if no live block starts there. */
kvb_status kvb_act_pool_free(kvb_act_pool *a, uintptr_t addr);

/* Garbage collection (§4.3.1 ❷): unmaps up to `n` idle chunks (the highest addresses first, extra
 * segments before the first); they go back to the activations' free list. Extra segments left with
 * nothing mapped are released. Returns the chunks unmapped. */
int kvb_act_pool_gc(kvb_act_pool *a, int n);

int kvb_act_pool_n_mapped(const kvb_act_pool *a);     /* chunks mapped in the pool's segments */
int kvb_act_pool_n_live(const kvb_act_pool *a);       /* of those, overlapped by a live block */
int kvb_act_pool_n_idle(const kvb_act_pool *a);       /* mapped - live: may leave the pool */
int kvb_act_pool_n_blocks(const kvb_act_pool *a);     /* live blocks */
int kvb_act_pool_n_segments(const kvb_act_pool *a);

/* Chunks that blocks of sizes[0..n) take when carved back to back from one free segment (what a
 * step's buffers take from an all-free pool whose first segment holds them): each size rounded up to
 * `align`, the sum rounded up to whole chunks. */
int64_t kvb_act_span_chunks(const size_t *sizes, int n, size_t align, size_t chunk_bytes);

/* Verifies the segments: blocks tile each segment in address order, no two free neighbours, live
 * counts equal the live blocks over each chunk, every live chunk mapped. KVB_OK or KVB_ERR_STATE. */
kvb_status kvb_act_pool_check(const kvb_act_pool *a);

#endif
