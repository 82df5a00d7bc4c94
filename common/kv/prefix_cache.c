/* kvbank — prefix cache over a block pool (see prefix_cache.h).
 *
 * A block id maps to at most one entry, so an entry lives in the slot of its block: slot i describes
 * block i (its key, its place in a hash bucket and in the LRU list). The slot arrays grow with the
 * largest published id (doubling, up to the pool's capacity). The map is chained: buckets[] holds the
 * first slot of each chain and slots link through `chain`; it doubles when the load exceeds 3/4.
 *
 * States of a block with respect to the cache:
 *   not cached                       - the pool alone manages it
 *   cached, refcount > 0             - in the map, not in the LRU
 *   cached, refcount 0               - in the map and in the LRU; held by the release hook (never on
 *                                      the pool's free list), evictable
 * Everything is O(1) amortized per block (expected, for the hash lookups). */
#include "common/kv/prefix_cache.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/kv/prefix_cache_impl.h"

#define NIL (-1)
#define MIN_BUCKETS 64
#define MIN_SLOTS 64

typedef struct pc_slot {
    uint64_t hash;     /* chained hash of the block (the map key) */
    uint64_t parent;   /* chained hash of the previous block, KVB_PREFIX_ROOT for a first block */
    int32_t chain;     /* next slot in the same bucket, NIL at the end */
    int32_t lru_prev;  /* LRU neighbours, NIL at the ends; meaningful only while in_lru */
    int32_t lru_next;
    uint8_t cached;    /* 1 while the block is an entry of the map */
    uint8_t in_lru;    /* 1 while cached with refcount 0 (held by the release hook) */
} pc_slot;

struct kvb_prefix_cache {
    kvb_block_pool *pool;  /* borrowed */
    int block_size;        /* tokens per block */
    int n_slots;           /* slots allocated: block ids [0, n_slots) */
    pc_slot *slots;        /* [n_slots] */
    int32_t *tokens;       /* [n_slots][block_size] token ids of cached blocks */
    int32_t *buckets;      /* [n_buckets] first slot of each chain, NIL if empty */
    size_t n_buckets;      /* power of two */
    int n_cached;          /* entries in the map */
    int32_t lru_head;      /* least recently released (evicted first), NIL if empty */
    int32_t lru_tail;      /* most recently released */
    int n_lru;
    kvb_prefix_stats stats;
    kvb_prefix_evict_fn evict_fn; /* called before an LRU block is handed out again (host tier) */
    void *evict_ud;
};

uint64_t kvb_prefix_hash(uint64_t parent, const int32_t *tokens, int block_size) {
    return XXH64(tokens, (size_t)block_size * sizeof(int32_t), parent);
}

/* ---------------------------------------------------------------- LRU list */

static void lru_push_tail(kvb_prefix_cache *c, int32_t i) {
    pc_slot *s = &c->slots[i];
    assert(s->cached && !s->in_lru);
    s->in_lru = 1;
    s->lru_next = NIL;
    s->lru_prev = c->lru_tail;
    if (c->lru_tail != NIL) c->slots[c->lru_tail].lru_next = i;
    else c->lru_head = i;
    c->lru_tail = i;
    c->n_lru++;
}

static void lru_remove(kvb_prefix_cache *c, int32_t i) {
    pc_slot *s = &c->slots[i];
    assert(s->in_lru);
    if (s->lru_prev != NIL) c->slots[s->lru_prev].lru_next = s->lru_next;
    else c->lru_head = s->lru_next;
    if (s->lru_next != NIL) c->slots[s->lru_next].lru_prev = s->lru_prev;
    else c->lru_tail = s->lru_prev;
    s->in_lru = 0;
    s->lru_prev = s->lru_next = NIL;
    c->n_lru--;
}

/* ---------------------------------------------------------------- map */

static size_t bucket_of(const kvb_prefix_cache *c, uint64_t hash) { return (size_t)(hash & (c->n_buckets - 1)); }

/* The slot whose key is exactly (hash, parent, tokens), or NIL. Entries that share the hash but not
 * the parent or the tokens (a collision) are skipped. */
static int32_t map_find(const kvb_prefix_cache *c, uint64_t hash, uint64_t parent, const int32_t *tokens) {
    size_t bs_bytes = (size_t)c->block_size * sizeof(int32_t);
    for (int32_t i = c->buckets[bucket_of(c, hash)]; i != NIL; i = c->slots[i].chain) {
        const pc_slot *s = &c->slots[i];
        if (s->hash == hash && s->parent == parent &&
            !memcmp(&c->tokens[(size_t)i * (size_t)c->block_size], tokens, bs_bytes))
            return i;
    }
    return NIL;
}

static void map_link(kvb_prefix_cache *c, int32_t i) {
    size_t b = bucket_of(c, c->slots[i].hash);
    c->slots[i].chain = c->buckets[b];
    c->buckets[b] = i;
}

static void map_unlink(kvb_prefix_cache *c, int32_t i) {
    int32_t *link = &c->buckets[bucket_of(c, c->slots[i].hash)];
    while (*link != i) {
        assert(*link != NIL); /* a cached slot is in its bucket */
        link = &c->slots[*link].chain;
    }
    *link = c->slots[i].chain;
    c->slots[i].chain = NIL;
}

static kvb_status map_grow(kvb_prefix_cache *c) {
    size_t nb = c->n_buckets * 2;
    int32_t *buckets = NULL;
    KVB_TRY(kvb_malloc(nb * sizeof *buckets, (void **)&buckets));
    for (size_t b = 0; b < nb; b++) buckets[b] = NIL;
    int32_t *old = c->buckets;
    size_t old_n = c->n_buckets;
    c->buckets = buckets;
    c->n_buckets = nb;
    for (size_t b = 0; b < old_n; b++) {
        int32_t i = old[b];
        while (i != NIL) {
            int32_t next = c->slots[i].chain;
            map_link(c, i);
            i = next;
        }
    }
    free(old);
    return KVB_OK;
}

/* Makes slots [0, need) exist. */
static kvb_status slots_reserve(kvb_prefix_cache *c, int need) {
    if (need <= c->n_slots) return KVB_OK;
    int cap = kvb_block_pool_id_limit(c->pool); /* own ids and attached segments */
    int n = c->n_slots > cap / 2 ? cap : KVB_MAX(c->n_slots * 2, MIN_SLOTS);
    n = KVB_MIN(KVB_MAX(n, need), cap);
    void *slots = c->slots;
    KVB_TRY(kvb_realloc_array(&slots, (size_t)n, sizeof *c->slots));
    c->slots = slots;
    size_t bs = (size_t)c->block_size;
    if ((size_t)n > SIZE_MAX / bs) return KVB_ERR_NOMEM;
    void *tokens = c->tokens;
    KVB_TRY(kvb_realloc_array(&tokens, (size_t)n * bs, sizeof *c->tokens));
    c->tokens = tokens;
    for (int i = c->n_slots; i < n; i++)
        c->slots[i] = (pc_slot){.chain = NIL, .lru_prev = NIL, .lru_next = NIL};
    c->n_slots = n;
    return KVB_OK;
}

/* Removes the entry of block i from the map (and the LRU if it is there). */
static void entry_drop(kvb_prefix_cache *c, int32_t i) {
    if (c->slots[i].in_lru) lru_remove(c, i);
    map_unlink(c, i);
    c->slots[i].cached = 0;
    c->n_cached--;
}

static kvb_status entry_insert(kvb_prefix_cache *c, uint64_t hash, uint64_t parent, const int32_t *tokens,
                               int32_t idx) {
    assert(kvb_block_pool_has(c->pool, idx));
    assert(kvb_block_pool_refcount(c->pool, idx) > 0); /* the publisher holds the block */
    if (idx < c->n_slots && c->slots[idx].cached) {
        KVB_LOG_W("prefix cache: block %d is already cached under another key; not published", (int)idx);
        return KVB_ERR_STATE;
    }
    KVB_TRY(slots_reserve(c, idx + 1));
    if ((size_t)c->n_cached + 1 > c->n_buckets / 4 * 3) KVB_TRY(map_grow(c));
    pc_slot *s = &c->slots[idx];
    s->hash = hash;
    s->parent = parent;
    s->cached = 1;
    s->in_lru = 0;
    memcpy(&c->tokens[(size_t)idx * (size_t)c->block_size], tokens, (size_t)c->block_size * sizeof(int32_t));
    map_link(c, idx);
    c->n_cached++;
    return KVB_OK;
}

/* The pool's release hook: a cached block whose last reference went stays cached, at the LRU tail. */
static int on_release(void *ud, int32_t idx) {
    kvb_prefix_cache *c = ud;
    if (idx >= c->n_slots || !c->slots[idx].cached) return 0;
    lru_push_tail(c, idx);
    return 1;
}

/* ---------------------------------------------------------------- interface */

kvb_status kvb_prefix_cache_create(kvb_block_pool *pool, kvb_prefix_cache **out) {
    if (!out) return KVB_ERR_INVALID;
    *out = NULL;
    if (!pool) return KVB_ERR_INVALID;
    kvb_status st;
    kvb_prefix_cache *c = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
    c->pool = pool;
    c->block_size = kvb_block_pool_geom(pool)->block_size;
    c->lru_head = c->lru_tail = NIL;
    c->n_buckets = MIN_BUCKETS;
    KVB_TRY_GOTO(kvb_malloc(c->n_buckets * sizeof *c->buckets, (void **)&c->buckets), fail_cache);
    for (size_t b = 0; b < c->n_buckets; b++) c->buckets[b] = NIL;
    kvb_block_pool_set_release_hook(pool, on_release, c);
    *out = c;
    return KVB_OK;

fail_cache:
    free(c);
    return st;
}

void kvb_prefix_cache_destroy(kvb_prefix_cache *c) {
    if (!c) return;
    kvb_block_pool_set_release_hook(c->pool, NULL, NULL);
    /* Unreferenced cached blocks go back to the pool; referenced ones return when their holders
     * drop them (no hook any more). */
    while (c->lru_head != NIL) {
        int32_t i = c->lru_head;
        entry_drop(c, i);
        kvb_block_pool_free_block(c->pool, i);
    }
    free(c->buckets);
    free(c->tokens);
    free(c->slots);
    free(c);
}

int kvb_prefix_cache_match_from(kvb_prefix_cache *c, uint64_t parent, const int32_t *tokens, int n, int max_blocks,
                                int32_t *blocks_out, uint64_t *last_hash) {
    int matched = 0;
    if (c && tokens && blocks_out && n > 0 && max_blocks > 0) {
        int n_full = KVB_MIN(n / c->block_size, max_blocks);
        for (int b = 0; b < n_full; b++) {
            const int32_t *tk = tokens + (size_t)b * (size_t)c->block_size;
            uint64_t h = kvb_prefix_hash(parent, tk, c->block_size);
            c->stats.queries++;
            int32_t i = map_find(c, h, parent, tk);
            if (i == NIL) break;
            c->stats.hits++;
            if (c->slots[i].in_lru) lru_remove(c, i);
            kvb_block_pool_ref(c->pool, i);
            blocks_out[matched++] = i;
            parent = h;
        }
    }
    if (last_hash) *last_hash = parent;
    return matched;
}

int kvb_prefix_cache_peek_from(const kvb_prefix_cache *c, uint64_t parent, const int32_t *tokens, int n, int max_blocks,
                               int32_t *blocks_out, uint64_t *last_hash) {
    int matched = 0;
    if (c && tokens && n > 0 && max_blocks > 0) {
        int n_full = KVB_MIN(n / c->block_size, max_blocks);
        for (int b = 0; b < n_full; b++) {
            const int32_t *tk = tokens + (size_t)b * (size_t)c->block_size;
            uint64_t h = kvb_prefix_hash(parent, tk, c->block_size);
            int32_t i = map_find(c, h, parent, tk);
            if (i == NIL) break;
            if (blocks_out) blocks_out[matched] = i;
            matched++;
            parent = h;
        }
    }
    if (last_hash) *last_hash = parent;
    return matched;
}

int kvb_prefix_cache_match(kvb_prefix_cache *c, const int32_t *tokens, int n, int max_blocks, int32_t *blocks_out,
                           uint64_t *last_hash) {
    return kvb_prefix_cache_match_from(c, KVB_PREFIX_ROOT, tokens, n, max_blocks, blocks_out, last_hash);
}

void kvb_prefix_cache_set_evict_hook(kvb_prefix_cache *c, kvb_prefix_evict_fn fn, void *ud) {
    c->evict_fn = fn;
    c->evict_ud = ud;
}

kvb_status kvb_prefix_cache_publish(kvb_prefix_cache *c, uint64_t parent, const int32_t *tokens, int32_t idx,
                                    uint64_t *hash_out) {
    if (!c || !tokens) return KVB_ERR_INVALID;
    assert(kvb_block_pool_has(c->pool, idx) && kvb_block_pool_refcount(c->pool, idx) > 0);
    uint64_t h = kvb_prefix_hash(parent, tokens, c->block_size);
    if (hash_out) *hash_out = h;
    if (map_find(c, h, parent, tokens) != NIL) return KVB_OK; /* identical block cached: keep it */
    return entry_insert(c, h, parent, tokens, idx);
}

kvb_status kvb__prefix_cache_insert_raw(kvb_prefix_cache *c, uint64_t hash, uint64_t parent, const int32_t *tokens,
                                        int32_t idx) {
    if (!c || !tokens) return KVB_ERR_INVALID;
    return entry_insert(c, hash, parent, tokens, idx);
}

/* Drops the least recently used unreferenced entry (after the evict hook); returns its block, now held
 * with refcount 0, or NIL. */
static int32_t evict_lru(kvb_prefix_cache *c) {
    int32_t i = c->lru_head;
    if (i == NIL) return NIL;
    if (c->evict_fn)
        c->evict_fn(c->evict_ud, c->slots[i].parent, c->tokens + (size_t)i * (size_t)c->block_size, i);
    entry_drop(c, i);
    c->stats.evictions++;
    return i;
}

kvb_status kvb_prefix_cache_alloc(kvb_prefix_cache *c, int32_t *out) {
    if (!c || !out) return KVB_ERR_INVALID;
    if (kvb_block_pool_n_free(c->pool) > 0) return kvb_block_pool_alloc(c->pool, out);
    int32_t i = evict_lru(c);
    if (i == NIL) return KVB_ERR_EXHAUSTED;
    kvb_block_pool_ref(c->pool, i); /* held with refcount 0 -> handed out with refcount 1 */
    *out = i;
    return KVB_OK;
}

int kvb_prefix_cache_n_available(const kvb_prefix_cache *c) { return kvb_block_pool_n_free(c->pool) + c->n_lru; }
int kvb_prefix_cache_n_cached(const kvb_prefix_cache *c) { return c->n_cached; }

kvb_status kvb_prefix_cache_evict(kvb_prefix_cache *c) {
    if (!c) return KVB_ERR_INVALID;
    int32_t i = evict_lru(c);
    if (i == NIL) return KVB_ERR_EXHAUSTED;
    kvb_block_pool_free_block(c->pool, i);
    return KVB_OK;
}

void kvb_prefix_cache_clear(kvb_prefix_cache *c) {
    if (!c) return;
    while (c->lru_head != NIL) {
        int32_t i = c->lru_head;
        entry_drop(c, i);
        kvb_block_pool_free_block(c->pool, i);
    }
}

int kvb_prefix_cache_drop_range(kvb_prefix_cache *c, int32_t first, int n) {
    if (!c || n <= 0) return 0;
    int dropped = 0;
    int64_t end = KVB_MIN((int64_t)first + n, (int64_t)c->n_slots);
    for (int32_t i = KVB_MAX(first, 0); i < end; i++) {
        if (!c->slots[i].in_lru) continue;
        entry_drop(c, i);
        kvb_block_pool_free_block(c->pool, i);
        dropped++;
    }
    return dropped;
}

int kvb_prefix_cache_drop_tail(kvb_prefix_cache *c, int first) {
    if (!c) return 0;
    first = KVB_MAX(first, 0);
    return kvb_prefix_cache_drop_range(c, first, kvb_block_pool_capacity(c->pool) - first);
}

int kvb_prefix_cache_is_cached(const kvb_prefix_cache *c, int32_t idx) {
    return c && idx >= 0 && idx < c->n_slots && c->slots[idx].cached;
}

int kvb_prefix_cache_key(const kvb_prefix_cache *c, int32_t idx, uint64_t *parent, const int32_t **tokens) {
    if (!kvb_prefix_cache_is_cached(c, idx)) return 0;
    *parent = c->slots[idx].parent;
    *tokens = &c->tokens[(size_t)idx * (size_t)c->block_size];
    return 1;
}

kvb_status kvb_prefix_cache_move(kvb_prefix_cache *c, int32_t from, int32_t to) {
    if (!c) return KVB_ERR_INVALID;
    if (!kvb_prefix_cache_is_cached(c, from) || kvb_prefix_cache_is_cached(c, to)) return KVB_ERR_STATE;
    assert(!c->slots[from].in_lru); /* referenced: the caller holds it */
    KVB_TRY(slots_reserve(c, to + 1)); /* may move c->slots and c->tokens */
    uint64_t hash = c->slots[from].hash, parent = c->slots[from].parent;
    entry_drop(c, from); /* leaves the slot's tokens in place */
    /* entry_insert cannot fail now: the slot exists, `to` is not cached, and the map has room for
     * the entry just dropped */
    kvb_status st = entry_insert(c, hash, parent, &c->tokens[(size_t)from * (size_t)c->block_size], to);
    assert(st == KVB_OK);
    return st;
}

int kvb_prefix_cache_idle_lru(const kvb_prefix_cache *c, int32_t *out, int max) {
    if (!c) return 0;
    int k = 0;
    for (int32_t i = c->lru_head; i != NIL && k < max; i = c->slots[i].lru_next) out[k++] = i;
    return k;
}

int kvb_prefix_cache_n_idle(const kvb_prefix_cache *c) { return c ? c->n_lru : 0; }

kvb_status kvb_prefix_cache_rehome(kvb_prefix_cache *c, int32_t from, int32_t to) {
    if (!c) return KVB_ERR_INVALID;
    if (!kvb_prefix_cache_is_cached(c, from) || !c->slots[from].in_lru || kvb_prefix_cache_is_cached(c, to) ||
        kvb_block_pool_refcount(c->pool, to) != 1)
        return KVB_ERR_STATE;
    KVB_TRY(slots_reserve(c, to + 1)); /* may move c->slots and c->tokens */
    int32_t prev = c->slots[from].lru_prev;
    uint64_t hash = c->slots[from].hash, parent = c->slots[from].parent;
    entry_drop(c, from); /* leaves the slot's tokens in place; `from` is held with refcount 0 */
    kvb_status st = entry_insert(c, hash, parent, &c->tokens[(size_t)from * (size_t)c->block_size], to);
    assert(st == KVB_OK); /* as in kvb_prefix_cache_move */
    kvb_block_pool_unref(c->pool, to); /* the release hook puts it at the LRU tail ... */
    lru_remove(c, to);                 /* ... but it keeps `from`'s place: after `prev` */
    pc_slot *s = &c->slots[to];
    s->in_lru = 1;
    s->lru_prev = prev;
    s->lru_next = prev != NIL ? c->slots[prev].lru_next : c->lru_head;
    if (prev != NIL) c->slots[prev].lru_next = to;
    else c->lru_head = to;
    if (s->lru_next != NIL) c->slots[s->lru_next].lru_prev = to;
    else c->lru_tail = to;
    c->n_lru++;
    kvb_block_pool_free_block(c->pool, from);
    return st;
}

int kvb_prefix_cache_demote(kvb_prefix_cache *c, int32_t idx) {
    if (!kvb_prefix_cache_is_cached(c, idx) || !c->slots[idx].in_lru) return 0;
    int hooked = c->evict_fn != NULL;
    if (hooked) c->evict_fn(c->evict_ud, c->slots[idx].parent, c->tokens + (size_t)idx * (size_t)c->block_size, idx);
    entry_drop(c, idx);
    c->stats.evictions++;
    kvb_block_pool_free_block(c->pool, idx);
    return hooked ? 1 : 0;
}

void kvb_prefix_cache_stats(const kvb_prefix_cache *c, kvb_prefix_stats *out) {
    if (!out) return;
    if (!c) {
        memset(out, 0, sizeof *out);
        return;
    }
    *out = c->stats;
}

/* ---------------------------------------------------------------- invariants (tests) */

#define CHECK(cond, ...)                                                                               \
    do {                                                                                               \
        if (!(cond)) {                                                                                 \
            KVB_LOG_E("prefix cache invariant: " __VA_ARGS__);                                         \
            bad++;                                                                                     \
        }                                                                                              \
    } while (0)

int kvb__prefix_cache_check(const kvb_prefix_cache *c) {
    int bad = 0;
    int id_limit = kvb_block_pool_id_limit(c->pool);
    /* Every chain entry is a cached slot in the right bucket, and each cached slot appears once. */
    int in_map = 0;
    for (size_t b = 0; b < c->n_buckets; b++) {
        for (int32_t i = c->buckets[b]; i != NIL; i = c->slots[i].chain) {
            CHECK(i >= 0 && i < c->n_slots, "bucket %zu links slot %d", b, (int)i);
            if (i < 0 || i >= c->n_slots) return bad;
            CHECK(c->slots[i].cached, "slot %d in bucket %zu is not cached", (int)i, b);
            CHECK(bucket_of(c, c->slots[i].hash) == b, "slot %d in the wrong bucket", (int)i);
            if (++in_map > c->n_slots) {
                CHECK(0, "bucket chains loop");
                return bad;
            }
        }
    }
    CHECK(in_map == c->n_cached, "%d entries in the map, n_cached %d", in_map, c->n_cached);
    /* LRU: a well-linked list of exactly the cached slots with refcount 0. */
    int in_lru = 0;
    int32_t prev = NIL;
    for (int32_t i = c->lru_head; i != NIL; i = c->slots[i].lru_next) {
        CHECK(c->slots[i].in_lru && c->slots[i].lru_prev == prev, "LRU link at slot %d", (int)i);
        prev = i;
        if (++in_lru > c->n_slots) {
            CHECK(0, "LRU loops");
            return bad;
        }
    }
    CHECK(prev == c->lru_tail, "LRU tail %d, list ends at %d", (int)c->lru_tail, (int)prev);
    CHECK(in_lru == c->n_lru, "%d slots in the LRU, n_lru %d", in_lru, c->n_lru);
    int cached = 0, held = 0;
    for (int32_t i = 0; i < c->n_slots; i++) {
        const pc_slot *s = &c->slots[i];
        if (!s->cached) {
            CHECK(!s->in_lru, "uncached slot %d in the LRU", (int)i);
            continue;
        }
        cached++;
        CHECK(kvb_block_pool_has(c->pool, i), "cached block %d is not in the pool", (int)i);
        if (!kvb_block_pool_has(c->pool, i)) continue;
        int rc = kvb_block_pool_refcount(c->pool, i);
        CHECK(!kvb_block_pool_is_free(c->pool, i), "cached block %d is on the free list", (int)i);
        CHECK(s->in_lru == (rc == 0), "cached block %d: refcount %d, in LRU %d", (int)i, rc, s->in_lru);
        held += s->in_lru;
    }
    CHECK(cached == c->n_cached, "%d cached slots, n_cached %d", cached, c->n_cached);
    CHECK(held == c->n_lru, "%d held slots, n_lru %d", held, c->n_lru);
    /* No other block is held: every refcount-0 block of the pool is free or in the LRU. */
    for (int32_t i = 0; i < id_limit; i++) {
        if (!kvb_block_pool_has(c->pool, i) || kvb_block_pool_refcount(c->pool, i) != 0) continue;
        int ok = kvb_block_pool_is_free(c->pool, i) || (i < c->n_slots && c->slots[i].in_lru);
        CHECK(ok, "block %d has refcount 0 but is neither free nor cached", (int)i);
    }
    return bad;
}
