/* kvbank — eLLM's map table (ellm-adaptive-kv-caching.txt §3.2, Fig. 7): KV of partial layers and
 * partial tokens of many requests, packed into units of F consecutive layers.
 *
 * How it sits in kvbank's block-major pool. A pool block is [L][2][bs][n_kv][d] (common/kv/block_pool.h):
 * its layers are contiguous slices, so F consecutive layers [k·F, k·F + F) of one block form a *slot*
 * of the same shape as the paper's unit ([F][2][bs][n_kv][d]). The map table takes whole pool blocks
 * (*carriers*) from a provider (the engine's pool, or the host tier's) and cuts each into
 * floor(L/F) full slots plus, when F does not divide L, one short slot of L mod F layers. A *unit* is
 * the KV of one request's logical token block (bs tokens) for one layer group g (layers
 * [g·F, min(L, g·F + F))); it may go into any free slot of any carrier that is long enough (units are
 * tagged with their layer group, as in the paper), so the window of a few layers that the recompute
 * and the swap need for many requests packs into few blocks instead of one whole L-layer block per
 * request. Layer l of a unit placed in slot k of carrier c lives at layer k·F + (l − g·F) of block c:
 * the executor hands attention kvb_block_pool_block_layer(pool, c, that layer), so nothing below the
 * planner changes. A carrier whose last unit leaves goes back to the provider at once.
 *
 * Entries carry the paper's fields: seq_id, token_id (first token of the logical block), layer_id
 * (first layer of the group), logical_block_id (token block · groups + group: the reshaped logical
 * table), physical_block_id (carrier · slots + slot: the reshaped physical table) and #filled. */
#ifndef KVB_POLICY_ELLM_TW_MAP_H
#define KVB_POLICY_ELLM_TW_MAP_H

#include <stdint.h>

#include "common/util/util.h"

/* ---------------------------------------------------------------- unit geometry (for the optimizer) */
/* Layers per unit actually used: min(F, L). */
int kvb_etw_map_unit_layers(int n_layers, int F);
/* Full slots per carrier: floor(L / min(F, L)) (>= 1). */
int kvb_etw_map_slots(int n_layers, int F);
/* Groups: ceil(L / min(F, L)). */
int kvb_etw_map_groups(int n_layers, int F);
/* Units one token block needs for the layers [lo, hi) (0 if hi <= lo). */
int kvb_etw_map_units_span(int n_layers, int F, int lo, int hi);
/* Most units one token block needs for any window of `depth` consecutive layers. */
int kvb_etw_map_units_window(int n_layers, int F, int depth);
/* Carriers that hold `token_blocks` token blocks' units for a window of `depth` layers, at most. */
int64_t kvb_etw_map_carriers(int n_layers, int F, int depth, int64_t token_blocks);
/* Host carriers for the swapped layers [n_rec, L) of `token_blocks` token blocks. */
int64_t kvb_etw_map_host_carriers(int n_layers, int F, int n_rec, int64_t token_blocks);

/* ---------------------------------------------------------------- the table */
/* Where carriers come from: whole blocks of a pool. alloc returns KVB_ERR_EXHAUSTED when none is free. */
typedef struct kvb_etw_map_blocks {
    void *ud;
    kvb_status (*alloc)(void *ud, int32_t *block); /* takes one block */
    void (*free)(void *ud, int32_t block);         /* gives it back */
} kvb_etw_map_blocks;

typedef struct kvb_etw_map kvb_etw_map;

typedef struct kvb_etw_map_entry {
    uint64_t seq_id;
    int32_t token_id;          /* first token of the logical block: token_block · bs */
    int32_t layer_id;          /* first layer of the group: g · F */
    int32_t logical_block_id;  /* token_block · groups + g */
    int32_t physical_block_id; /* carrier · slots_per_carrier + slot */
    int32_t filled;            /* tokens of the block stored (#filled, <= bs) */
} kvb_etw_map_entry;

/* Where one layer of one unit lives: pool block `block`, its layer `layer` (block-major slice). */
typedef struct kvb_etw_map_loc {
    int32_t block;
    int layer;
} kvb_etw_map_loc;

typedef struct kvb_etw_map_stats {
    int64_t units;           /* mapped units */
    int64_t carriers;        /* blocks held */
    int64_t carrier_allocs;  /* blocks taken from the provider so far */
    int64_t lookups;
    double used_bytes;       /* Σ filled tokens × layers of the unit, in token-layers */
    double held_bytes;       /* carriers × L × bs, in token-layers */
} kvb_etw_map_stats;

/* A table for an L-layer model with F layers per unit and bs tokens per block, taking carriers from
 * `blocks` (copied). Caller owns the result. KVB_ERR_INVALID for a bad argument. */
kvb_status kvb_etw_map_create(int n_layers, int F, int block_size, const kvb_etw_map_blocks *blocks,
                              kvb_etw_map **out);
/* Gives every carrier back and frees the table. NULL-safe. */
void kvb_etw_map_destroy(kvb_etw_map *m);

int kvb_etw_map_groups_of(const kvb_etw_map *m);
int kvb_etw_map_slots_of(const kvb_etw_map *m);

/* Maps the unit (seq, token_block, group g) with `filled` tokens to a free slot long enough for it
 * (first fit over carriers that have one, else a new carrier). KVB_ERR_STATE if it is mapped already,
 * KVB_ERR_INVALID for a bad group or filled, KVB_ERR_EXHAUSTED (nothing changed) if no carrier can be
 * had, KVB_ERR_NOMEM. */
kvb_status kvb_etw_map_add(kvb_etw_map *m, uint64_t seq, int32_t token_block, int g, int filled);
/* Updates #filled of a mapped unit (KVB_ERR_NOT_FOUND if it is not mapped). */
kvb_status kvb_etw_map_set_filled(kvb_etw_map *m, uint64_t seq, int32_t token_block, int g, int filled);
/* Where layer `layer` of (seq, token_block) lives; KVB_ERR_NOT_FOUND if its unit is not mapped. */
kvb_status kvb_etw_map_lookup(kvb_etw_map *m, uint64_t seq, int32_t token_block, int layer, kvb_etw_map_loc *out);
/* The entry of a mapped unit (KVB_ERR_NOT_FOUND otherwise). */
kvb_status kvb_etw_map_entry_of(const kvb_etw_map *m, uint64_t seq, int32_t token_block, int g,
                                kvb_etw_map_entry *out);
/* Unmaps one unit (KVB_ERR_NOT_FOUND if not mapped); an emptied carrier goes back at once. */
kvb_status kvb_etw_map_remove(kvb_etw_map *m, uint64_t seq, int32_t token_block, int g);
/* Unmaps every unit of `seq`; returns how many. */
int kvb_etw_map_remove_seq(kvb_etw_map *m, uint64_t seq);
/* Unmaps everything (all carriers go back). */
void kvb_etw_map_clear(kvb_etw_map *m);
void kvb_etw_map_get_stats(const kvb_etw_map *m, kvb_etw_map_stats *out);
/* Checks every invariant (each slot holds at most one unit, each entry's slot is marked and fits, no
 * carrier is held empty, counts agree); KVB_OK or KVB_ERR_STATE with the first violation logged. */
kvb_status kvb_etw_map_check(const kvb_etw_map *m);

#endif
