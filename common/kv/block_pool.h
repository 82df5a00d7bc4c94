/* kvbank — a pool of KV blocks in the block-major layout (SwiftCache §3.4).
 *
 * Block i occupies bytes [i*block_bytes, (i+1)*block_bytes) of the pool's memory and holds
 * [n_layers][2 (K,V)][block_size][n_kv_heads][head_dim] elements, so all layers of a block are
 * contiguous and the pool grows or shrinks at its tail without moving any other block (O(1) resize).
 *
 * Blocks are reference counted: a sequence holds a reference to each block in its table, and the
 * prefix cache lets sequences share full blocks. The pool itself knows nothing of hashes.
 *
 * Id layout (lending, SwiftCache §3.4-3.5). The pool's own memory holds `capacity` blocks, ids
 * [0, capacity); the own blocks in use are the prefix [0, n_own), and resize moves n_own (a worker
 * lends the tail of that range). A master adds borrowed memory as attached *segments*: contiguous id
 * ranges that all start at or above `capacity`, so own resizes and segments never share an id. A
 * detached segment's range is retired and reused first-fit by later attaches (the rest of a longer
 * retired range stays retired; adjacent retired ranges merge; a retired range at the top of the id
 * space is trimmed), so lend/reclaim cycles do not grow the id space. Every id is allocated lowest
 * first, so own blocks fill before borrowed ones. Addresses stay O(1): own block i is at
 * mem + i * block_bytes, attached block i at a per-id base pointer set by its segment. */
#ifndef KVB_KV_BLOCK_POOL_H
#define KVB_KV_BLOCK_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/util.h"
#include "common/util/kv_geom.h"

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
int kvb_block_pool_n_blocks(const kvb_block_pool *p);   /* blocks currently in the pool: n_own + n_attached */
int kvb_block_pool_n_own(const kvb_block_pool *p);      /* own blocks in the pool: ids [0, n_own) */
int kvb_block_pool_n_attached(const kvb_block_pool *p); /* blocks of attached segments */
int kvb_block_pool_capacity(const kvb_block_pool *p);   /* most own blocks the pool's memory can hold */
/* One past the highest id that may exist now (capacity + the attached and retired id ranges): the
 * size of a table indexed by block id. Grows on attach, may shrink on detach. */
int kvb_block_pool_id_limit(const kvb_block_pool *p);
int kvb_block_pool_n_free(const kvb_block_pool *p);     /* blocks with refcount 0 and not held */
/* 1 if `idx` is a block of the pool now (own and below n_own, or in an attached segment); 0 for any
 * other int32 value (never asserts). */
int kvb_block_pool_has(const kvb_block_pool *p, int32_t idx);
/* 1 if `idx` lies in the attached id space (idx >= capacity): a borrowed block. */
int kvb_block_pool_is_attached(const kvb_block_pool *p, int32_t idx);
/* Address of block `idx` (all layers) and of its slice for `layer`. `idx` is an own id below capacity
 * or a block of an attached segment. */
void *kvb_block_pool_block(const kvb_block_pool *p, int32_t idx);
void *kvb_block_pool_block_layer(const kvb_block_pool *p, int32_t idx, int layer);

/* Takes a free block (lowest index first, so that the tail stays free for shrinking), refcount 1.
 * KVB_ERR_EXHAUSTED if none is free. */
kvb_status kvb_block_pool_alloc(kvb_block_pool *p, int32_t *out);
/* Takes the specific free block `idx` (refcount 1), as alloc would. KVB_ERR_STATE if it is not on
 * the free list (referenced, held, or not in the pool). */
kvb_status kvb_block_pool_take(kvb_block_pool *p, int32_t idx);
/* Adds / drops a reference. Dropping the last one returns the block to the free list unless the
 * pool's release hook keeps it (the prefix cache does, for reusable full blocks). */
void kvb_block_pool_ref(kvb_block_pool *p, int32_t idx);
void kvb_block_pool_unref(kvb_block_pool *p, int32_t idx);
int kvb_block_pool_refcount(const kvb_block_pool *p, int32_t idx);
/* 1 if block `idx` is on the free list (refcount 0 and not kept by the release hook), 0 otherwise
 * (also for any id that is not a block of the pool now: removed own ids, retired ranges, negatives). */
int kvb_block_pool_is_free(const kvb_block_pool *p, int32_t idx);

/* Hook called when a block's refcount drops to 0; returns nonzero to keep the block out of the free
 * list (the hook's owner later calls kvb_block_pool_free_block). */
typedef int (*kvb_block_release_fn)(void *ud, int32_t idx);
void kvb_block_pool_set_release_hook(kvb_block_pool *p, kvb_block_release_fn fn, void *ud);
/* Returns a block with refcount 0 that a release hook kept to the free list. */
void kvb_block_pool_free_block(kvb_block_pool *p, int32_t idx);

/* O(1) resize of the own range at its tail (SwiftCache §3.4): sets n_own to `n_blocks` (0..capacity).
 * Growing appends free blocks; shrinking removes the last own blocks and fails with KVB_ERR_STATE
 * unless every removed block is free. Attached segments are not affected. */
kvb_status kvb_block_pool_resize(kvb_block_pool *p, int n_blocks);

/* Attaches `n` (>= 1) blocks of borrowed memory `mem` ([n][block_bytes], block-major like the pool's
 * own memory; borrowed: the caller keeps it mapped until the segment is detached) as a segment of
 * free blocks with ids [*first_id, *first_id + n), all >= capacity (see the id layout above).
 * KVB_ERR_INVALID for a bad argument or when the id space would pass INT32_MAX, KVB_ERR_NOMEM. */
kvb_status kvb_block_pool_attach(kvb_block_pool *p, void *mem, int n, int32_t *first_id);
/* Detaches [first_id, first_id + n): a whole attached segment, or the front of one (partial reclaim;
 * the rest [first_id + n, end) stays attached with its addresses), else KVB_ERR_INVALID.
 * Every block must be on the free list, neither referenced nor held by the release hook, else
 * KVB_ERR_STATE and nothing changes. Afterwards no id of the range is handed out until a later attach
 * reuses it, and the pool never touches `mem` again. */
kvb_status kvb_block_pool_detach(kvb_block_pool *p, int32_t first_id, int n);

/* ---------------------------------------------------------------- sliced pools (OrbitFlow §4, Fig. 6)
 *
 * A sliced pool counts its memory in (block, layer) slices so that a block can keep some layers on the
 * device and others elsewhere (the host tier), and a layer moved away returns its slice for any other
 * block's layer. Physical slice k is bytes [k * layer_bytes, (k+1) * layer_bytes) of the own memory:
 * the same memory as the block-major layout read as slices (own block i holds slices i*L .. i*L+L-1),
 * allocated lowest first, so a free tail of blocks can still be lent (resize). Block ids are virtual:
 * ids [0, n_ids), more than the memory holds whole, each with a physical slice per layer or none.
 *
 * Differences from a block-major pool:
 *  - alloc / take give a block with every layer resident (so code that knows nothing of slices works
 *    unchanged); alloc_bare gives an id with none; slice_alloc / slice_free add or drop one layer;
 *  - n_free counts blocks that alloc could hand out: min(free ids, free slices / n_layers);
 *  - a block going back to the free list (last reference, or free_block) returns its slices; a block a
 *    release hook holds keeps them (a cached prefix block stays readable);
 *  - kvb_block_pool_block is not defined (assert): address layers with kvb_block_pool_block_layer,
 *    which asserts that the layer is resident;
 *  - n_blocks, n_own and capacity count physical blocks (slices / n_layers); id_limit is n_ids;
 *  - attach / detach return KVB_ERR_UNSUPPORTED (a sliced model does not borrow).
 * Scratch slices (prefetch buffers) come from the same memory and count against it. */

/* Creates a sliced pool of n_blocks physical blocks (n_blocks * n_layers slices) over `mem` and n_ids
 * (>= 1) virtual ids, all free. KVB_ERR_INVALID as kvb_block_pool_create, or when the tables would
 * overflow. Caller owns the result. */
kvb_status kvb_block_pool_create_sliced(const kvb_kv_geom *g, void *mem, size_t mem_bytes, int n_blocks, int n_ids,
                                        kvb_block_pool **out);
int kvb_block_pool_is_sliced(const kvb_block_pool *p);
int kvb_block_pool_n_slices(const kvb_block_pool *p);      /* physical slices: n_own * n_layers (0 unless sliced) */
int kvb_block_pool_n_free_slices(const kvb_block_pool *p); /* of those, free */
int kvb_block_pool_n_free_ids(const kvb_block_pool *p);    /* ids on the free list (= n_free unless sliced) */
/* An id with no resident layer, refcount 1. KVB_ERR_EXHAUSTED (no free id), KVB_ERR_UNSUPPORTED (not sliced). */
kvb_status kvb_block_pool_alloc_bare(kvb_block_pool *p, int32_t *out);
/* 1 if `layer` of block idx has a physical slice. Sliced pools only. */
int kvb_block_pool_slice_resident(const kvb_block_pool *p, int32_t idx, int layer);
/* The id holding physical slice `slice`, -1 when it is free or a scratch slice. Sliced pools only. */
int32_t kvb_block_pool_slice_owner(const kvb_block_pool *p, int32_t slice);
/* Own blocks at the top of [0, n_own) that could be given away now: free ids (block-major), or physical
 * blocks whose every slice is free or held by an unreferenced block (sliced). */
int kvb_block_pool_free_tail(const kvb_block_pool *p);
/* Slices of referenced blocks (not of held or free ones, not scratch): O(ids * layers). 0 unless sliced. */
int64_t kvb_block_pool_referenced_slices(const kvb_block_pool *p);
/* Resident layers of block idx (n_layers in a block-major pool). */
int kvb_block_pool_n_resident(const kvb_block_pool *p, int32_t idx);
/* Gives `layer` of block idx (referenced or held) a slice: KVB_OK if it has one already,
 * KVB_ERR_EXHAUSTED if none is free. The slice's content is undefined. */
kvb_status kvb_block_pool_slice_alloc(kvb_block_pool *p, int32_t idx, int layer);
/* Returns the slice of a resident layer (its KV is gone from the device). */
void kvb_block_pool_slice_free(kvb_block_pool *p, int32_t idx, int layer);
/* A slice tied to no block (a prefetch buffer), lowest free first: KVB_ERR_EXHAUSTED,
 * KVB_ERR_UNSUPPORTED (not sliced). Give it back with scratch_free. */
kvb_status kvb_block_pool_scratch_alloc(kvb_block_pool *p, int32_t *slice);
void kvb_block_pool_scratch_free(kvb_block_pool *p, int32_t slice);
/* Address of physical slice `slice` ([2][block_size][n_kv_heads][head_dim]). */
void *kvb_block_pool_slice_addr(const kvb_block_pool *p, int32_t slice);

#endif
