/* kvbank — KV eTensor slots of eLLM (ellm-elastic-memory.txt §4.2.1-4.2.2).
 *
 * One virtual range per concurrency slot, `slot_chunks` chunks long (the model's context length rounded
 * up to whole chunks), reserved once and reused across requests: a request's KV is one contiguous
 * virtual range, and physical chunks of the unified pool (common/mem/elastic_pool.h) are mapped under
 * it on demand, always as a prefix [0, n_mapped) of the slot. The slots are consecutive ranges of one
 * reservation (slot i at chunk i * slot_chunks), so that the whole KV space is one address range a
 * block pool can index (block-major: block id -> base + id * block bytes). A slot is
 *   - empty:  nothing mapped, no request;
 *   - live:   a request's KV; its first `need` chunks hold that KV, mapped chunks above `need` (a
 *             larger cached slot it reused, a speculatively pre-mapped next chunk) are reclaimable;
 *   - cached: the request finished and the slot stays mapped (eTensor pooling, §4.2.2): every mapped
 *             chunk is reclaimable.
 * A new request takes the smallest cached slot whose mapped size covers its need (best fit, §4.2.2),
 * else the cached slot with the most chunks mapped, else an empty slot, and maps what it still lacks.
 * The layout inside a slot is the caller's (kvbank: block-major, see policy/ellm_elastic.h).
 *
 * Not thread-safe (the planner of one model calls it between steps). */
#ifndef KVB_KV_SLOT_POOL_H
#define KVB_KV_SLOT_POOL_H

#include <stdint.h>

#include "common/mem/elastic_pool.h"

typedef struct kvb_slot_pool kvb_slot_pool;

/* Reserves `n_slots` (>= 1) slots of `slot_chunks` (>= 1) chunks in `ep` (borrowed for the pool's
 * lifetime), as one reservation. Caller owns the result. */
kvb_status kvb_slot_pool_create(kvb_epool *ep, int n_slots, int slot_chunks, kvb_slot_pool **out);
/* Unmaps and releases every slot (mapped chunks go back to the KV free list). NULL-safe. */
void kvb_slot_pool_destroy(kvb_slot_pool *sp);

int kvb_slot_pool_n_slots(const kvb_slot_pool *sp);
int kvb_slot_pool_slot_chunks(const kvb_slot_pool *sp);
uintptr_t kvb_slot_pool_base(const kvb_slot_pool *sp, int slot);
/* The reservation holding every slot (base of slot 0) and its size in chunks (n_slots * slot_chunks). */
int32_t kvb_slot_pool_reservation(const kvb_slot_pool *sp);
int kvb_slot_pool_is_live(const kvb_slot_pool *sp, int slot);
int kvb_slot_pool_n_mapped(const kvb_slot_pool *sp, int slot);
int kvb_slot_pool_need(const kvb_slot_pool *sp, int slot);

/* Takes a slot for a request that needs `need` chunks now (see the header comment for which); the
 * slot is live with that need. Nothing is mapped here. KVB_ERR_EXHAUSTED if every slot is live. */
kvb_status kvb_slot_pool_acquire(kvb_slot_pool *sp, int need, int *slot);
/* The request of a live slot ended: the slot becomes cached with its chunks mapped. */
void kvb_slot_pool_release(kvb_slot_pool *sp, int slot);
/* Sets how many leading chunks of a live slot hold KV (0..slot_chunks); mapped chunks above it
 * become reclaimable. */
void kvb_slot_pool_set_need(kvb_slot_pool *sp, int slot, int need);

/* Where kvb_slot_pool_map may take chunks when the KV side has no free one. */
typedef enum kvb_slot_reclaim {
    KVB_SLOT_RECLAIM_NONE = 0,   /* free chunks only */
    KVB_SLOT_RECLAIM_CACHED = 1, /* and cached slots (speculative pre-mapping) */
    KVB_SLOT_RECLAIM_ALL = 2,    /* and the excess of other live slots */
} kvb_slot_reclaim;

/* Maps chunks [n_mapped, n) of a live slot. Each comes from the KV side's free chunks, else, as
 * `from` allows, by moving a reclaimable chunk here (mapped here first, unmapped there after: §5.1):
 * the least recently released cached slot's last chunk first, then the last excess chunk of another
 * live slot. KVB_ERR_EXHAUSTED when the KV side has none left (what was mapped stays mapped). */
kvb_status kvb_slot_pool_map(kvb_slot_pool *sp, int slot, int n, kvb_slot_reclaim from);

/* Unmaps up to `n` reclaimable chunks (cached slots, least recently released first, each from its
 * end; then live slots' excess); they go back to the KV free list. Returns the chunks unmapped. */
int kvb_slot_pool_reclaim(kvb_slot_pool *sp, int n);

int kvb_slot_pool_n_reclaimable(const kvb_slot_pool *sp); /* mapped chunks holding no live KV */
int kvb_slot_pool_n_needed(const kvb_slot_pool *sp);      /* sum of live slots' needs */
int kvb_slot_pool_n_excess(const kvb_slot_pool *sp);      /* mapped chunks of live slots above their need */
int kvb_slot_pool_n_mapped_total(const kvb_slot_pool *sp);
int kvb_slot_pool_n_free_slots(const kvb_slot_pool *sp);  /* slots that are not live */

/* Verifies: every slot's mapped chunks form the prefix [0, n_mapped) of its reservation, a live
 * slot's need is mapped, the counters add up. KVB_OK or KVB_ERR_STATE. */
kvb_status kvb_slot_pool_check(const kvb_slot_pool *sp);

#endif
