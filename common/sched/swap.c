/* kvbank — vLLM's swap (KVB_OP_SWAP_OUT / SWAP_IN): a request's KV moves between its pool blocks and new
 * host-tier blocks over the host link, and the request between the running and the swapped lists. With
 * HCache (hcache.c) its first layers leave as saved hidden states instead and are rebuilt at swap-in. */
#include "common/sched/state.h"

kvb_status kvb__swap_out(kvb_engine *e, kvb__seq *s, int n_hidden) {
    int n = s->bt.n;
    KVB_TRY(kvb__host_blocks_push(e, &s->host_bt, n)); /* counted by the plan's check */
    KVB_TRY(kvb__host_move(e, KVB_XFER_D2H, s->bt.ids, s->host_bt.ids, n, kvb__hcache_swap_out(e, s, n_hidden)));
    kvb__seq_release_blocks(e, s);
    kvb__list_remove(&e->running, s);
    s->paused = 0;
    kvb__list_insert_ordered(&e->swapped, s);
    e->stats.swap_outs++;
    return KVB_OK;
}

kvb_status kvb__swap_in(kvb_engine *e, kvb__seq *s, const kvb_plan_op *op) {
    int n = s->host_bt.n;
    for (int j = 0; j < n; j++) {
        int32_t id = op->placed ? op->block0 + j : -1;
        if (id >= 0) KVB_TRY(kvb_block_pool_take(e->pool, id)); /* checked free by the plan's check */
        else KVB_TRY(kvb_prefix_cache_alloc(e->pc, &id)); /* counted by the plan's check */
        kvb_status st = kvb_block_table_push(&s->bt, id);
        if (st != KVB_OK) {
            kvb_block_pool_unref(e->pool, id);
            return st;
        }
    }
    KVB_TRY(kvb__host_move(e, KVB_XFER_H2D, s->bt.ids, s->host_bt.ids, n, kvb__hcache_swapped_layers(s)));
    KVB_TRY(kvb__hcache_restore(e, s));
    kvb_block_table_release(&s->host_bt, e->ht_pool);
    kvb__list_remove(&e->swapped, s);
    kvb__list_insert_ordered(&e->running, s);
    e->stats.swap_ins++;
    return KVB_OK;
}
