/* kvbank — prefix cache over a block pool (vLLM-style automatic prefix caching).
 *
 * A full block is identified by a hash chained over the token ids of the whole prefix up to and
 * including the block: h_i = XXH64(tokens of block i, seed = h_{i-1}), h_{-1} = KVB_PREFIX_ROOT.
 * Published blocks stay in the cache after their last reference is dropped and are evicted in LRU
 * order when the pool runs out of free blocks. The tokens of every cached block are kept and compared
 * on a hit, so a hash collision can never hand out the wrong KV (lossless). */
#ifndef KVB_KV_PREFIX_CACHE_H
#define KVB_KV_PREFIX_CACHE_H

#include <stdint.h>

#include "common/kv/block_pool.h"

#define KVB_PREFIX_ROOT 0x6b76626b7631ull /* "kvbkv1": seed of the first block's hash */

typedef struct kvb_prefix_cache kvb_prefix_cache;

/* Creates a prefix cache over `pool` (borrowed; installs the pool's release hook; the pool must outlive
 * the cache). Caller owns it. Like the pool, not thread-safe. */
kvb_status kvb_prefix_cache_create(kvb_block_pool *pool, kvb_prefix_cache **out);
/* Removes the release hook and returns every unreferenced cached block to the pool's free list
 * (referenced ones go there when their last reference is dropped). NULL-safe. */
void kvb_prefix_cache_destroy(kvb_prefix_cache *c);

/* Hash of one block given its parent's hash. */
uint64_t kvb_prefix_hash(uint64_t parent, const int32_t *tokens, int block_size);

/* Finds the longest cached run of full blocks that starts the sequence `tokens[0..n)`, at most
 * `max_blocks`. Takes one reference on each matched block and writes their ids to blocks_out and the
 * chained hash of the last one to *last_hash (KVB_PREFIX_ROOT when none matched). */
int kvb_prefix_cache_match(kvb_prefix_cache *c, const int32_t *tokens, int n, int max_blocks, int32_t *blocks_out,
                           uint64_t *last_hash);

/* The same, continuing a chain whose last matched block has hash `parent` (tokens start at that
 * block's successor). */
int kvb_prefix_cache_match_from(kvb_prefix_cache *c, uint64_t parent, const int32_t *tokens, int n, int max_blocks,
                                int32_t *blocks_out, uint64_t *last_hash);

/* The same match without taking anything: no reference, no LRU or statistics change. `blocks_out` may
 * be NULL. For planning (what admitting a request would reuse). */
int kvb_prefix_cache_peek_from(const kvb_prefix_cache *c, uint64_t parent, const int32_t *tokens, int n, int max_blocks,
                               int32_t *blocks_out, uint64_t *last_hash);

/* Called with a cached, unreferenced block (its parent hash, tokens and id) just before
 * kvb_prefix_cache_alloc evicts it to hand it out again: the last moment its KV can be read (a host
 * tier copies it out here). The hook must not call back into the cache. */
typedef void (*kvb_prefix_evict_fn)(void *ud, uint64_t parent, const int32_t *tokens, int32_t idx);
void kvb_prefix_cache_set_evict_hook(kvb_prefix_cache *c, kvb_prefix_evict_fn fn, void *ud);

/* Publishes a full block `idx` (held by the caller) whose tokens are `tokens[0..block_size)` under
 * parent hash `parent`. Returns its hash in *hash_out. If an identical block is already cached, the
 * cache keeps the existing one and `idx` is freed as usual when its last reference goes.
 * KVB_ERR_STATE if `idx` is already cached under another key (a block is at most one entry). */
kvb_status kvb_prefix_cache_publish(kvb_prefix_cache *c, uint64_t parent, const int32_t *tokens, int32_t idx,
                                    uint64_t *hash_out);

/* Allocates a block for writing: a free one if any, else the least recently used unreferenced cached
 * block (evicted from the cache). KVB_ERR_EXHAUSTED when every block is referenced. */
kvb_status kvb_prefix_cache_alloc(kvb_prefix_cache *c, int32_t *out);

/* Evicts the least recently used unreferenced cached block to the pool's free list (the evict hook is
 * called first). KVB_ERR_EXHAUSTED when no cached block is unreferenced. */
kvb_status kvb_prefix_cache_evict(kvb_prefix_cache *c);

/* Blocks that kvb_prefix_cache_alloc could hand out now (free + evictable). */
int kvb_prefix_cache_n_available(const kvb_prefix_cache *c);
int kvb_prefix_cache_n_cached(const kvb_prefix_cache *c);
/* Drops every unreferenced cached block back to the free list. */
void kvb_prefix_cache_clear(kvb_prefix_cache *c);
/* Drops the unreferenced cached own blocks with id in [first, capacity) back to the free list (before
 * shrinking the pool to `first` own blocks); returns how many it dropped. Referenced ones stay, and
 * attached segments (ids >= capacity) are not touched. */
int kvb_prefix_cache_drop_tail(kvb_prefix_cache *c, int first);
/* Drops the unreferenced cached blocks with id in [first, first + n) back to the free list (before
 * detaching a segment); returns how many it dropped. Referenced ones stay. */
int kvb_prefix_cache_drop_range(kvb_prefix_cache *c, int32_t first, int n);
/* 1 if block `idx` is an entry of the cache. */
int kvb_prefix_cache_is_cached(const kvb_prefix_cache *c, int32_t idx);
/* The key of cached block `idx`: its parent's hash and its tokens ([block_size], valid until the cache
 * changes). Returns 1, or 0 (nothing written) when `idx` is not an entry of the cache. */
int kvb_prefix_cache_key(const kvb_prefix_cache *c, int32_t idx, uint64_t *parent, const int32_t **tokens);
/* Moves the entry of block `from` (cached and referenced) to block `to` (referenced, not cached) after
 * the caller copied the KV: later matches hand out `to`, and `from` becomes an ordinary block that
 * goes to the free list with its last reference. KVB_ERR_STATE if `from` is not cached or `to` is. */
kvb_status kvb_prefix_cache_move(kvb_prefix_cache *c, int32_t from, int32_t to);

/* The unreferenced cached blocks, least recently used first (the eviction order); writes up to `max`
 * ids to `out` and returns how many. O(cached idle blocks). */
int kvb_prefix_cache_idle_lru(const kvb_prefix_cache *c, int32_t *out, int max);
/* How many cached blocks are unreferenced (evictable). */
int kvb_prefix_cache_n_idle(const kvb_prefix_cache *c);
/* Moves the entry of `from` (cached, unreferenced) to `to` (allocated by the caller: refcount 1, not
 * cached) after the caller copied the KV; `to` takes the caller's reference, becomes unreferenced and
 * keeps `from`'s place in the LRU order; `from` goes back to the free list. KVB_ERR_STATE otherwise. */
kvb_status kvb_prefix_cache_rehome(kvb_prefix_cache *c, int32_t from, int32_t to);
/* Evicts the cached unreferenced block `idx` to the free list, calling the evict hook first (a host
 * tier copies it out there). Returns 1 if a hook ran (the entry lives on there), 0 if it was dropped
 * or `idx` is not an idle cached block. */
int kvb_prefix_cache_demote(kvb_prefix_cache *c, int32_t idx);

typedef struct kvb_prefix_stats {
    uint64_t queries;      /* blocks looked up */
    uint64_t hits;         /* blocks found */
    uint64_t evictions;
} kvb_prefix_stats;
void kvb_prefix_cache_stats(const kvb_prefix_cache *c, kvb_prefix_stats *out);

#endif
