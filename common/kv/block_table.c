/* kvbank — a sequence's block table (see block_table.h). */
#include "common/kv/block_table.h"

#include <assert.h>
#include <limits.h>
#include <stdlib.h>

kvb_status kvb_block_table_push(kvb_block_table *t, int32_t id) {
    assert(t && id >= 0);
    if (t->n == t->cap) {
        if (t->cap > INT_MAX / 2) {
            KVB_LOG_E("block table: more than %d blocks", t->cap);
            return KVB_ERR_NOMEM;
        }
        int cap = t->cap ? 2 * t->cap : 8;
        void *ids = t->ids;
        KVB_TRY(kvb_realloc_array(&ids, (size_t)cap, sizeof *t->ids));
        t->ids = ids;
        t->cap = cap;
    }
    t->ids[t->n++] = id;
    return KVB_OK;
}

void kvb_block_table_release(kvb_block_table *t, kvb_block_pool *pool) {
    if (!t) return;
    /* Newest block first: with a prefix cache, the deepest blocks of a prefix reach the LRU first and
     * so are evicted before the shallower blocks that other prefixes share. */
    for (int i = t->n - 1; i >= 0; i--) kvb_block_pool_unref(pool, t->ids[i]);
    t->n = 0;
}

void kvb_block_table_free(kvb_block_table *t) {
    if (!t) return;
    assert(t->n == 0); /* released first: otherwise its references would leak */
    free(t->ids);
    t->ids = NULL;
    t->n = 0;
    t->cap = 0;
}
