/* kvbank — prefix cache internals that tests reach (not part of the public interface). */
#ifndef KVB_KV_PREFIX_CACHE_IMPL_H
#define KVB_KV_PREFIX_CACHE_IMPL_H

#include <stdint.h>

#include "common/kv/prefix_cache.h"

/* Inserts an entry for block `idx` (held by the caller, not cached yet) under an arbitrary `hash`
 * instead of the one computed from `parent` and `tokens[0..block_size)`: tests use it to force hash
 * collisions. KVB_ERR_STATE if `idx` is already cached. */
kvb_status kvb__prefix_cache_insert_raw(kvb_prefix_cache *c, uint64_t hash, uint64_t parent, const int32_t *tokens,
                                        int32_t idx);

/* Checks every internal invariant (map, per-block entries, LRU list against the pool's refcounts and
 * free list) and returns the number of violations, each logged. O(capacity): tests only. */
int kvb__prefix_cache_check(const kvb_prefix_cache *c);

#endif
