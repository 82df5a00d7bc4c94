/* kvbank — lending (SwiftCache §3.4-3.5): a worker shrinks its own blocks to lend their tail and grows
 * back; a master attaches borrowed memory as extra blocks and detaches it on reclaim, moving live
 * blocks elsewhere or preempting their sequences first (the fence: no step runs meanwhile). */
#include <assert.h>
#include <limits.h>
#include <string.h>

#include "common/sched/state.h"

int kvb_engine_n_own(const kvb_engine *e) { return kvb_block_pool_n_own(e->pool); }
int kvb_engine_capacity(const kvb_engine *e) { return kvb_block_pool_capacity(e->pool); }

int kvb_engine_free_tail(const kvb_engine *e) {
    if (kvb__sliced(e)) return kvb_block_pool_free_tail(e->pool); /* physical blocks whose slices are all free */
    int n = 0;
    /* refcount 0 is free or an unreferenced prefix-cache entry (the only holder of such blocks) */
    for (int32_t i = kvb_block_pool_n_own(e->pool) - 1; i >= 0 && kvb_block_pool_refcount(e->pool, i) == 0; i--) n++;
    return n;
}

kvb_status kvb_engine_shrink(kvb_engine *e, int n_own_new) {
    int n_own = kvb_block_pool_n_own(e->pool);
    if (n_own_new < 0 || n_own_new > n_own) {
        KVB_LOG_E("engine: shrink to %d own blocks, %d owned now", n_own_new, n_own);
        return KVB_ERR_INVALID;
    }
    KVB_TRY(kvb__host_tier_quiesce(e)); /* no write-back reads a block of the tail once it goes */
    if (kvb__sliced(e)) { /* a sliced pool: the tail's slices must be free (ids are virtual); cached blocks go */
        int L = e->geom.n_layers;
        for (int32_t k = n_own_new * L; k < n_own * L; k++) {
            int32_t o = kvb_block_pool_slice_owner(e->pool, k);
            if (o >= 0 && kvb_block_pool_refcount(e->pool, o) > 0) {
                KVB_LOG_D("engine: cannot shrink to %d own blocks: slice %d is in use", n_own_new, (int)k);
                return KVB_ERR_STATE;
            }
        }
        for (int32_t k = n_own_new * L; k < n_own * L; k++) {
            int32_t o = kvb_block_pool_slice_owner(e->pool, k);
            if (o >= 0) kvb_prefix_cache_drop_range(e->pc, o, 1);
        }
        kvb_status st = kvb_block_pool_resize(e->pool, n_own_new);
        if (st == KVB_ERR_STATE) KVB_LOG_D("engine: cannot shrink to %d own blocks: a slice of the tail is in use", n_own_new);
        return st;
    }
    for (int32_t i = n_own_new; i < n_own; i++) {
        if (kvb_block_pool_refcount(e->pool, i) > 0) {
            KVB_LOG_D("engine: cannot shrink to %d own blocks: block %d is in use", n_own_new, (int)i);
            return KVB_ERR_STATE;
        }
    }
    kvb_prefix_cache_drop_tail(e->pc, n_own_new);
    kvb_status st = kvb_block_pool_resize(e->pool, n_own_new);
    assert(st == KVB_OK); /* every block of the tail is free now */
    return st;
}

kvb_status kvb_engine_grow(kvb_engine *e, int n_own_new) {
    int n_own = kvb_block_pool_n_own(e->pool), cap = kvb_block_pool_capacity(e->pool);
    if (n_own_new < n_own || n_own_new > cap) {
        KVB_LOG_E("engine: grow to %d own blocks, %d owned now, capacity %d", n_own_new, n_own, cap);
        return KVB_ERR_INVALID;
    }
    KVB_TRY(kvb_block_pool_resize(e->pool, n_own_new));
    e->starved = 0;
    return KVB_OK;
}

int64_t kvb_engine_max_request_tokens(const kvb_engine *e) {
    int64_t most = 0;
    const kvb__seq_list *lists[] = {&e->waiting, &e->running, &e->swapped};
    for (int i = 0; i < 3; i++)
        for (const kvb__seq *s = lists[i]->head; s; s = s->next) most = KVB_MAX(most, (int64_t)s->cap);
    return most;
}

int kvb_engine_starved(const kvb_engine *e) {
    if (e->starved) return 1;
    if (!e->waiting.head) return 0;
    if (kvb__sliced(e))
        return kvb__seq_need_blocks(e, e->waiting.head) * kvb__slices_min_layers(e) > kvb_block_pool_n_slices(e->pool);
    return kvb__seq_need_blocks(e, e->waiting.head) > kvb_block_pool_n_blocks(e->pool);
}

/* The planner sizes the stage buffers for the loans now attached (SwiftCache's LSC: plan_pool
 * ATTACH / DETACH). */
static kvb_status stage_for_loans(kvb_engine *e, kvb_pool_event_kind kind, int n_blocks) {
    kvb_pool_plan pp = {.stage_slots = kvb_stager_n_buffers(e->stager) / 2};
    kvb_pool_event ev = {.kind = kind, .now_s = kvb_now_s(), .n_blocks = n_blocks};
    KVB_TRY(kvb__plan_pool(e, &ev, &pp));
    if (pp.stage_slots < 0) return KVB_ERR_INVALID;
    return kvb__stage_reserve(e, pp.stage_slots);
}

static int find_loan(const kvb_engine *e, uint64_t tag) {
    for (int i = 0; i < e->n_loans; i++)
        if (e->loans[i].tag == tag) return i;
    return -1;
}

kvb_status kvb_engine_attach(kvb_engine *e, uint64_t tag, void *mem, size_t bytes, int n_blocks) {
    size_t bb = kvb_kv_block_bytes(&e->geom);
    if (!mem || n_blocks < 1 || bytes / bb < (size_t)n_blocks) {
        KVB_LOG_E("engine: attach of loan %llu: %d blocks of %zu bytes need memory of at least that size (%zu)",
                  (unsigned long long)tag, n_blocks, bb, bytes);
        return KVB_ERR_INVALID;
    }
    if (find_loan(e, tag) >= 0) {
        KVB_LOG_E("engine: loan %llu is already attached", (unsigned long long)tag);
        return KVB_ERR_INVALID;
    }
    if (n_blocks > INT_MAX - e->n_borrowed) return KVB_ERR_INVALID;
    if (e->n_loans == e->loans_cap) {
        int cap = e->loans_cap ? 2 * e->loans_cap : 4;
        KVB_TRY(kvb_realloc_array((void **)&e->loans, (size_t)cap, sizeof *e->loans));
        e->loans_cap = cap;
    }
    int32_t first;
    KVB_TRY(kvb_block_pool_attach(e->pool, mem, n_blocks, &first));
    e->loans[e->n_loans++] = (kvb__loan){.tag = tag, .first = first, .n = n_blocks};
    e->n_borrowed += n_blocks;
    kvb_status st = stage_for_loans(e, KVB_POOL_ATTACH, n_blocks);
    if (st != KVB_OK) {
        KVB_LOG_E("engine: no stage buffers for %d borrowed blocks: loan %llu not attached", e->n_borrowed,
                  (unsigned long long)tag);
        e->n_loans--;
        e->n_borrowed -= n_blocks;
        kvb_status st2 = kvb_block_pool_detach(e->pool, first, n_blocks);
        assert(st2 == KVB_OK); /* its blocks are all free: nothing ran on them */
        (void)st2;
        return st;
    }
    e->starved = 0;
    KVB_LOG_D("engine: loan %llu attached as blocks [%d, %d)", (unsigned long long)tag, (int)first,
              (int)first + n_blocks);
    return KVB_OK;
}

int kvb_engine_n_borrowed(const kvb_engine *e) { return e->n_borrowed; }

int kvb_engine_loans(const kvb_engine *e, uint64_t *tags, int *n_blocks, int max) {
    for (int i = 0; i < e->n_loans && i < max; i++) {
        if (tags) tags[i] = e->loans[i].tag;
        if (n_blocks) n_blocks[i] = e->loans[i].n;
    }
    return e->n_loans;
}

/* State of one detach: the range [first, first + n) leaving the pool. */
typedef struct detach_ctx {
    int32_t first;
    int n;
    uint8_t *taken;      /* [n] 1 once the detach holds the block (its only reference) */
    int32_t *moved_to;   /* [n] new id of a moved block (the detach holds one reference), -1 */
    int32_t *scratch;    /* [n] range ids of a sequence being preempted; idle cached ones (keep_cached) */
    kvb_detach_stats st;
} detach_ctx;

static int in_range(const detach_ctx *d, int32_t id) { return id >= d->first && id - d->first < d->n; }

/* Takes block `id` of the range out of circulation once nothing references it: a prefix-cache
 * entry there is dropped, then the detach holds the block so that no allocation can hand it out. */
static void fence_block(kvb_engine *e, detach_ctx *d, int32_t id) {
    int off = id - d->first;
    if (d->taken[off] || kvb_block_pool_refcount(e->pool, id) > 0) return;
    if (!kvb_block_pool_is_free(e->pool, id)) d->st.dropped += kvb_prefix_cache_drop_range(e->pc, id, 1);
    kvb__block_forget(e, id);
    kvb_status st = kvb_block_pool_take(e->pool, id);
    assert(st == KVB_OK); /* refcount 0 and no cache entry: on the free list */
    (void)st;
    d->taken[off] = 1;
}

static int seq_uses_range(const kvb__seq *s, const detach_ctx *d) {
    for (int j = 0; j < s->bt.n; j++)
        if (in_range(d, s->bt.ids[j])) return 1;
    return 0;
}

/* Preempts `s` by recompute and fences the range blocks it released. */
static void preempt_in_range(kvb_engine *e, detach_ctx *d, kvb__seq *s) {
    int m = 0;
    for (int j = 0; j < s->bt.n; j++)
        if (in_range(d, s->bt.ids[j])) d->scratch[m++] = s->bt.ids[j]; /* a table holds a block once */
    kvb__preempt_seq(e, s);
    for (int i = 0; i < m; i++) fence_block(e, d, d->scratch[i]);
    d->st.preempted++;
}

/* The newest running sequence that still references the range (NULL if none). */
static kvb__seq *newest_on_range(kvb_engine *e, const detach_ctx *d) {
    for (kvb__seq *s = e->running.tail; s; s = s->prev)
        if (seq_uses_range(s, d)) return s;
    return NULL;
}

/* Moves every range block of `s` to a block outside the range (or preempts `s`, or newer sequences
 * to make room). Returns the running sequence to visit next. */
static kvb__seq *move_seq(kvb_engine *e, detach_ctx *d, kvb__seq *s) {
    kvb_backend *be = kvb_model_backend(e->m);
    size_t bb = kvb_kv_block_bytes(&e->geom);
    for (int j = 0; j < s->bt.n; j++) {
        int32_t id = s->bt.ids[j];
        if (!in_range(d, id)) continue;
        int off = id - d->first;
        if (d->moved_to[off] < 0) {
            int32_t nid;
            /* the range's idle blocks are fenced, so whatever comes back lies outside it */
            while (kvb_prefix_cache_alloc(e->pc, &nid) != KVB_OK) {
                kvb__seq *victim = newest_on_range(e, d);
                assert(victim); /* s itself is still on the range */
                if (victim == s) {
                    kvb__seq *next = s->next;
                    preempt_in_range(e, d, s);
                    return next;
                }
                preempt_in_range(e, d, victim);
            }
            assert(!in_range(d, nid));
            kvb_status st = be->iface->copy(be->ctx, kvb_block_pool_block(e->pool, nid),
                                            kvb_block_pool_block(e->pool, id), bb);
            if (st != KVB_OK) {
                KVB_LOG_W("engine: copying block %d failed (%s); preempting request %llu instead", (int)id,
                          kvb_status_str(st), (unsigned long long)s->id);
                kvb_block_pool_unref(e->pool, nid);
                kvb__seq *next = s->next;
                preempt_in_range(e, d, s);
                return next;
            }
            /* keep the prefix-cache entry on the copy; if that fails (no memory for the cache's slot
             * table) the entry stays on the old block and is dropped with it */
            if (kvb_prefix_cache_is_cached(e->pc, id)) (void)kvb_prefix_cache_move(e->pc, id, nid);
            d->moved_to[off] = nid; /* the allocation's reference is the detach's until the end */
            d->st.moved++;
        }
        kvb_block_pool_ref(e->pool, d->moved_to[off]);
        s->bt.ids[j] = d->moved_to[off];
        kvb_block_pool_unref(e->pool, id);
        fence_block(e, d, id);
    }
    return s->next;
}

/* A detach keeps the master's prefix cache where it can (issue 10): the range's idle cached blocks, most
 * recently used first, are copied into blocks outside the range: free ones first (as many as stay free
 * once the range's live blocks have moved; lowest ids, so the master's own memory first), then ones
 * that an idle cached block colder than the one being kept gave up (evicted as usual: demoted to the
 * host tier when it has a prefix cache). So after the detach the pool holds the most recently used
 * blocks it can. What cannot be kept is demoted to the host tier when there is one, else dropped. The
 * range's free blocks are fenced first, so every block handed out here lies outside it. Without memory
 * for the LRU order the range's cached blocks are dropped as before. */
static void keep_cached(kvb_engine *e, detach_ctx *d) {
    kvb_backend *be = kvb_model_backend(e->m);
    size_t bb = kvb_kv_block_bytes(&e->geom);
    int live = 0;
    for (int i = 0; i < d->n; i++) {
        int32_t id = d->first + i;
        if (kvb_block_pool_is_free(e->pool, id)) fence_block(e, d, id);
        else if (kvb_block_pool_refcount(e->pool, id) > 0) live++;
    }
    int n_idle = kvb_prefix_cache_n_idle(e->pc);
    int32_t *lru = NULL; /* [n_idle] idle cached blocks, coldest first */
    if (!n_idle || kvb_malloc((size_t)n_idle * sizeof *lru, (void **)&lru) != KVB_OK) return;
    n_idle = kvb_prefix_cache_idle_lru(e->pc, lru, n_idle);
    int spare = kvb_block_pool_n_free(e->pool) - live; /* free blocks outside the range no move needs */
    int cold = 0;                                       /* next colder block outside the range */
    for (int k = n_idle - 1; k >= 0; k--) {
        int32_t h = lru[k], nid;
        if (!in_range(d, h)) continue;
        if (spare <= 0) {
            while (cold < k && in_range(d, lru[cold])) cold++;
            if (cold < k) { /* colder than h: it makes room */
                (void)kvb_prefix_cache_demote(e->pc, lru[cold++]);
                spare++;
            }
        }
        if (spare > 0 && kvb_block_pool_alloc(e->pool, &nid) == KVB_OK) {
            spare--;
            assert(!in_range(d, nid));
            if (be->iface->copy(be->ctx, kvb_block_pool_block(e->pool, nid), kvb_block_pool_block(e->pool, h), bb) ==
                    KVB_OK &&
                kvb_prefix_cache_rehome(e->pc, h, nid) == KVB_OK) {
                kvb__block_forget(e, h);
                fence_block(e, d, h);
                d->st.kept++;
                continue;
            }
            kvb_block_pool_unref(e->pool, nid);
        }
        if (e->host_prefix) { /* no room in the pool: the host tier keeps it */
            uint64_t stores = e->stats.host_tier_stores;
            (void)kvb_prefix_cache_demote(e->pc, h);
            fence_block(e, d, h);
            if (e->stats.host_tier_stores > stores) d->st.demoted++;
            else d->st.dropped++;
        }
    }
    free(lru);
}

kvb_status kvb_engine_detach(kvb_engine *e, uint64_t tag, int lender_dead, kvb_detach_stats *out) {
    int li = find_loan(e, tag);
    if (li < 0) {
        if (out) *out = (kvb_detach_stats){0};
        return KVB_ERR_NOT_FOUND;
    }
    return kvb_engine_detach_front(e, tag, e->loans[li].n, lender_dead, out);
}

kvb_status kvb_engine_detach_front(kvb_engine *e, uint64_t tag, int n_blocks, int lender_dead, kvb_detach_stats *out) {
    if (out) *out = (kvb_detach_stats){0};
    int li = find_loan(e, tag);
    if (li < 0) return KVB_ERR_NOT_FOUND;
    if (n_blocks < 1 || n_blocks > e->loans[li].n) {
        KVB_LOG_E("engine: detach of %d block(s) from loan %llu of %d", n_blocks, (unsigned long long)tag,
                  e->loans[li].n);
        return KVB_ERR_INVALID;
    }
    detach_ctx d = {.first = e->loans[li].first, .n = n_blocks};
    kvb_status st;
    KVB_TRY(kvb__host_tier_quiesce(e)); /* no write-back reads the range once it goes */
    KVB_TRY_GOTO(kvb_calloc((size_t)d.n, sizeof *d.taken, (void **)&d.taken), fail_scratch);
    KVB_TRY_GOTO(kvb_malloc((size_t)d.n * sizeof *d.moved_to, (void **)&d.moved_to), fail_scratch);
    KVB_TRY_GOTO(kvb_malloc((size_t)d.n * sizeof *d.scratch, (void **)&d.scratch), fail_scratch);
    for (int i = 0; i < d.n; i++) d.moved_to[i] = -1;
    int can_move = !lender_dead && kvb_model_backend(e->m)->iface->copy;

    /* 1. idle blocks (free, or cached and unreferenced) leave circulation; hot cached ones are kept */
    if (can_move) keep_cached(e, &d);
    for (int i = 0; i < d.n; i++) fence_block(e, &d, d.first + i);
    /* 2. live blocks: only running sequences hold blocks (a waiting one holds none) */
    for (kvb__seq *s = e->running.head; s;) {
        if (!seq_uses_range(s, &d)) {
            s = s->next;
        } else if (!can_move) {
            kvb__seq *next = s->next;
            preempt_in_range(e, &d, s); /* nothing is read from the range */
            s = next;
        } else {
            s = move_seq(e, &d, s);
        }
    }
    /* 3. the copies keep only their sequences' references; the range is held by the detach alone */
    for (int i = 0; i < d.n; i++)
        if (d.moved_to[i] >= 0) kvb_block_pool_unref(e->pool, d.moved_to[i]);
    for (int i = 0; i < d.n; i++) {
        fence_block(e, &d, d.first + i);
        assert(d.taken[i] && kvb_block_pool_refcount(e->pool, d.first + i) == 1);
        kvb_block_pool_unref(e->pool, d.first + i); /* no cache entry: back to the free list */
    }
    st = kvb_block_pool_detach(e->pool, d.first, d.n);
    if (st != KVB_OK) { /* only the split of a segment can fail (no memory for its entry) */
        assert(st == KVB_ERR_NOMEM && d.n < e->loans[li].n); /* the range's blocks are free: still usable */
        goto fail_scratch;
    }
    if (d.n < e->loans[li].n) { /* partial: the loan keeps its tail */
        e->loans[li].first += d.n;
        e->loans[li].n -= d.n;
    } else {
        memmove(&e->loans[li], &e->loans[li + 1], (size_t)(e->n_loans - li - 1) * sizeof *e->loans);
        e->n_loans--;
    }
    e->n_borrowed -= d.n;
    if (stage_for_loans(e, KVB_POOL_DETACH, d.n) != KVB_OK)
        KVB_LOG_W("engine: could not resize the stage buffers; they keep %d slots", kvb_stager_n_buffers(e->stager) / 2);
    KVB_LOG_D("engine: %d block(s) of loan %llu detached%s: %d blocks moved, %d cached kept, %d demoted, %d "
              "dropped, %d requests preempted",
              d.n, (unsigned long long)tag, lender_dead ? " (lender dead)" : "", d.st.moved, d.st.kept, d.st.demoted,
              d.st.dropped, d.st.preempted);
    if (out) *out = d.st;
fail_scratch:
    free(d.taken);
    free(d.moved_to);
    free(d.scratch);
    return st;
}
