/* kvbank — a sequence's block table: the ids of its blocks, in token order.
 * A small value type (the scheduler embeds one per sequence); every id in it holds one reference. */
#ifndef KVB_KV_BLOCK_TABLE_H
#define KVB_KV_BLOCK_TABLE_H

#include <stdint.h>

#include "common/kv/block_pool.h"

typedef struct kvb_block_table {
    int32_t *ids; /* [n] block ids in the sequence's pool */
    int n;
    int cap;
} kvb_block_table;

/* Appends `id` (the caller's reference moves into the table). */
kvb_status kvb_block_table_push(kvb_block_table *t, int32_t id);
/* Drops the table's reference on every block and empties it (keeps the allocation). */
void kvb_block_table_release(kvb_block_table *t, kvb_block_pool *pool);
/* Frees the id array; the table must have been released first. NULL-safe. */
void kvb_block_table_free(kvb_block_table *t);

#endif
