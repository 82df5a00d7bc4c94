/* kvbank — a pool of KV blocks in the block-major layout (SwiftCache §3.4).
 *
 * Block i occupies bytes [i*block_bytes, (i+1)*block_bytes) of the pool's memory and holds
 * [n_layers][2 (K,V)][block_size][n_kv_heads][head_dim] elements, so all layers of a block are
 * contiguous and the pool grows or shrinks at its tail without moving any other block (O(1) resize).
 *
 * Blocks are reference counted: a sequence holds a reference to each block in its table, and the
 * prefix cache lets sequences share full blocks. The pool itself knows nothing of hashes. */
#ifndef KVB_KV_BLOCK_POOL_H
#define KVB_KV_BLOCK_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/util.h"
#include "kernels/backend.h"

typedef struct kvb_block_pool kvb_block_pool;

/* Bytes of one block and of one layer's slice of a block. */
size_t kvb_kv_block_bytes(const kvb_kv_geom *g);
size_t kvb_kv_layer_bytes(const kvb_kv_geom *g);
/* Validates a geometry (all fields positive, no overflow). */
kvb_status kvb_kv_geom_check(const kvb_kv_geom *g);

/* A pool is not thread-safe: one thread (the executor of its model) calls it. Ids and layers passed
 * to the functions below must be in range (the engine's bug otherwise: assert).
 *
 * Creates a pool of `n_blocks` blocks over `mem` (`mem_bytes` bytes; borrowed for the pool's lifetime;
 * backend memory, which on the CPU backend is host memory such as a kvb_region). The capacity, the
 * most blocks the memory can hold, is mem_bytes / block_bytes; n_blocks <= capacity. All blocks start
 * free. Caller owns the result. */
kvb_status kvb_block_pool_create(const kvb_kv_geom *g, void *mem, size_t mem_bytes, int n_blocks,
                                 kvb_block_pool **out);
void kvb_block_pool_destroy(kvb_block_pool *p);

const kvb_kv_geom *kvb_block_pool_geom(const kvb_block_pool *p);
int kvb_block_pool_n_blocks(const kvb_block_pool *p);   /* blocks currently in the pool */
int kvb_block_pool_capacity(const kvb_block_pool *p);   /* most blocks the memory can hold */
int kvb_block_pool_n_free(const kvb_block_pool *p);     /* blocks with refcount 0 and not held */
/* Address of block `idx` (all layers) and of its slice for `layer`. */
void *kvb_block_pool_block(const kvb_block_pool *p, int32_t idx);
void *kvb_block_pool_block_layer(const kvb_block_pool *p, int32_t idx, int layer);

/* Takes a free block (lowest index first, so that the tail stays free for shrinking), refcount 1.
 * KVB_ERR_EXHAUSTED if none is free. */
kvb_status kvb_block_pool_alloc(kvb_block_pool *p, int32_t *out);
/* Adds / drops a reference. Dropping the last one returns the block to the free list unless the
 * pool's release hook keeps it (the prefix cache does, for reusable full blocks). */
void kvb_block_pool_ref(kvb_block_pool *p, int32_t idx);
void kvb_block_pool_unref(kvb_block_pool *p, int32_t idx);
int kvb_block_pool_refcount(const kvb_block_pool *p, int32_t idx);
/* 1 if block `idx` is on the free list (refcount 0 and not kept by the release hook), 0 otherwise
 * (also for ids past n_blocks, which are no longer in the pool). */
int kvb_block_pool_is_free(const kvb_block_pool *p, int32_t idx);

/* Hook called when a block's refcount drops to 0; returns nonzero to keep the block out of the free
 * list (the hook's owner later calls kvb_block_pool_free_block). */
typedef int (*kvb_block_release_fn)(void *ud, int32_t idx);
void kvb_block_pool_set_release_hook(kvb_block_pool *p, kvb_block_release_fn fn, void *ud);
/* Returns a block with refcount 0 that a release hook kept to the free list. */
void kvb_block_pool_free_block(kvb_block_pool *p, int32_t idx);

/* O(1) resize at the tail (SwiftCache §3.4): growing appends free blocks (up to capacity); shrinking
 * removes the last blocks and fails with KVB_ERR_STATE unless every removed block is free. */
kvb_status kvb_block_pool_resize(kvb_block_pool *p, int n_blocks);

#endif
