/* kvbank — block-major KV block pool (see block_pool.h).
 *
 * The free set is a bitmap with a 64-ary summary tree on top: bit i of level 0 is set when block i
 * is free; bit j of level k+1 is set when word j of level k is nonzero. Finding the lowest free block
 * descends from the single top word with count-trailing-zeros, so alloc, free and the per-block work
 * of a resize are O(log64 capacity) — at most 6 levels for 2^31 blocks. */
#include "common/kv/block_pool.h"

#include <assert.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LEVELS 8 /* ceil(log64(2^31)) = 6, with room to spare */

struct kvb_block_pool {
    kvb_kv_geom geom;
    size_t block_bytes;   /* bytes of one block (all layers) */
    size_t layer_bytes;   /* bytes of one layer's slice of a block */
    unsigned char *mem;   /* [capacity][block_bytes], borrowed */
    size_t mem_bytes;
    int capacity;         /* most blocks mem can hold (<= INT32_MAX) */
    int n_blocks;         /* blocks currently in the pool: ids [0, n_blocks) */
    int n_free;           /* set bits of the level-0 bitmap */
    int32_t *refcount;    /* [capacity] references per block; 0 for free, held and removed blocks */
    int n_levels;         /* levels of the free bitmap; the last has exactly one word */
    uint64_t *level[MAX_LEVELS]; /* level[k]: [n_words[k]] bits, see the top of the file */
    size_t n_words[MAX_LEVELS];
    kvb_block_release_fn release;  /* may be NULL */
    void *release_ud;
};

/* ---------------------------------------------------------------- geometry */

/* Multiplies the geometry's factors; 0 on a non-positive field or overflow. */
static size_t geom_product(const kvb_kv_geom *g, int with_layers) {
    if (!g || g->n_layers <= 0 || g->n_kv_heads <= 0 || g->head_dim <= 0 || g->block_size <= 0 || g->elem_size <= 0)
        return 0;
    size_t r = 2; /* K and V */
    if (__builtin_mul_overflow(r, (size_t)g->block_size, &r)) return 0;
    if (__builtin_mul_overflow(r, (size_t)g->n_kv_heads, &r)) return 0;
    if (__builtin_mul_overflow(r, (size_t)g->head_dim, &r)) return 0;
    if (__builtin_mul_overflow(r, (size_t)g->elem_size, &r)) return 0;
    if (with_layers && __builtin_mul_overflow(r, (size_t)g->n_layers, &r)) return 0;
    return r;
}

size_t kvb_kv_block_bytes(const kvb_kv_geom *g) { return geom_product(g, 1); }
size_t kvb_kv_layer_bytes(const kvb_kv_geom *g) { return geom_product(g, 0); }

kvb_status kvb_kv_geom_check(const kvb_kv_geom *g) {
    if (!g) return KVB_ERR_INVALID;
    if (g->n_layers <= 0 || g->n_kv_heads <= 0 || g->head_dim <= 0 || g->block_size <= 0 || g->elem_size <= 0) {
        KVB_LOG_E("kv geometry: every field must be positive (layers %d, kv heads %d, head dim %d, block size %d, "
                  "elem size %d)",
                  g->n_layers, g->n_kv_heads, g->head_dim, g->block_size, g->elem_size);
        return KVB_ERR_INVALID;
    }
    if (kvb_kv_block_bytes(g) == 0) {
        KVB_LOG_E("kv geometry: block size in bytes overflows (layers %d, kv heads %d, head dim %d, block size %d, "
                  "elem size %d)",
                  g->n_layers, g->n_kv_heads, g->head_dim, g->block_size, g->elem_size);
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

/* ---------------------------------------------------------------- free bitmap */

static int bit_test(const kvb_block_pool *p, int32_t i) {
    return (int)((p->level[0][(size_t)i >> 6] >> (i & 63)) & 1u);
}

static void bit_set(kvb_block_pool *p, int32_t i) {
    size_t pos = (size_t)i;
    for (int k = 0; k < p->n_levels; k++) {
        uint64_t *w = &p->level[k][pos >> 6];
        int was_empty = (*w == 0);
        *w |= (uint64_t)1 << (pos & 63);
        if (!was_empty) break; /* the levels above already know this word is nonzero */
        pos >>= 6;
    }
}

static void bit_clear(kvb_block_pool *p, int32_t i) {
    size_t pos = (size_t)i;
    for (int k = 0; k < p->n_levels; k++) {
        uint64_t *w = &p->level[k][pos >> 6];
        *w &= ~((uint64_t)1 << (pos & 63));
        if (*w != 0) break; /* the word still has free bits: the levels above are unchanged */
        pos >>= 6;
    }
}

/* Lowest free block, or -1. */
static int32_t bit_first(const kvb_block_pool *p) {
    int top = p->n_levels - 1;
    if (p->level[top][0] == 0) return -1;
    size_t pos = 0;
    for (int k = top; k >= 0; k--) pos = (pos << 6) | (size_t)__builtin_ctzll(p->level[k][pos]);
    return (int32_t)pos;
}

static void mark_free(kvb_block_pool *p, int32_t idx) {
    bit_set(p, idx);
    p->n_free++;
}

/* ---------------------------------------------------------------- pool */

kvb_status kvb_block_pool_create(const kvb_kv_geom *g, void *mem, size_t mem_bytes, int n_blocks,
                                 kvb_block_pool **out) {
    if (!out) return KVB_ERR_INVALID;
    *out = NULL;
    KVB_TRY(kvb_kv_geom_check(g));
    size_t bb = kvb_kv_block_bytes(g);
    if (!mem) {
        KVB_LOG_E("block pool: no memory");
        return KVB_ERR_INVALID;
    }
    size_t cap = mem_bytes / bb;
    if (cap > INT32_MAX) cap = INT32_MAX; /* block ids are int32 */
    if (cap == 0) {
        KVB_LOG_E("block pool: %zu bytes of memory cannot hold one block of %zu bytes", mem_bytes, bb);
        return KVB_ERR_INVALID;
    }
    if (n_blocks < 0 || (size_t)n_blocks > cap) {
        KVB_LOG_E("block pool: %d blocks requested, the memory holds %zu", n_blocks, cap);
        return KVB_ERR_INVALID;
    }

    kvb_status st;
    kvb_block_pool *p = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *p, (void **)&p));
    p->geom = *g;
    p->block_bytes = bb;
    p->layer_bytes = kvb_kv_layer_bytes(g);
    p->mem = mem;
    p->mem_bytes = mem_bytes;
    p->capacity = (int)cap;
    KVB_TRY_GOTO(kvb_calloc(cap, sizeof *p->refcount, (void **)&p->refcount), fail_pool);
    size_t bits = cap;
    for (;;) {
        size_t words = (bits + 63) / 64;
        assert(p->n_levels < MAX_LEVELS);
        p->n_words[p->n_levels] = words;
        KVB_TRY_GOTO(kvb_calloc(words, sizeof(uint64_t), (void **)&p->level[p->n_levels]), fail_pool);
        p->n_levels++;
        if (words == 1) break;
        bits = words;
    }
    for (int32_t i = 0; i < n_blocks; i++) mark_free(p, i);
    p->n_blocks = n_blocks;
    *out = p;
    return KVB_OK;

fail_pool:
    kvb_block_pool_destroy(p);
    return st;
}

void kvb_block_pool_destroy(kvb_block_pool *p) {
    if (!p) return;
    for (int k = 0; k < p->n_levels; k++) free(p->level[k]);
    free(p->refcount);
    free(p);
}

const kvb_kv_geom *kvb_block_pool_geom(const kvb_block_pool *p) { return &p->geom; }
int kvb_block_pool_n_blocks(const kvb_block_pool *p) { return p->n_blocks; }
int kvb_block_pool_capacity(const kvb_block_pool *p) { return p->capacity; }
int kvb_block_pool_n_free(const kvb_block_pool *p) { return p->n_free; }

void *kvb_block_pool_block(const kvb_block_pool *p, int32_t idx) {
    assert(idx >= 0 && idx < p->capacity);
    return p->mem + (size_t)idx * p->block_bytes;
}

void *kvb_block_pool_block_layer(const kvb_block_pool *p, int32_t idx, int layer) {
    assert(idx >= 0 && idx < p->capacity);
    assert(layer >= 0 && layer < p->geom.n_layers);
    return p->mem + (size_t)idx * p->block_bytes + (size_t)layer * p->layer_bytes;
}

kvb_status kvb_block_pool_alloc(kvb_block_pool *p, int32_t *out) {
    int32_t idx = bit_first(p);
    if (idx < 0) return KVB_ERR_EXHAUSTED;
    assert(idx < p->n_blocks && p->refcount[idx] == 0);
    bit_clear(p, idx);
    p->n_free--;
    p->refcount[idx] = 1;
    *out = idx;
    return KVB_OK;
}

void kvb_block_pool_ref(kvb_block_pool *p, int32_t idx) {
    assert(idx >= 0 && idx < p->n_blocks);
    /* A block is referenced, or held by the release hook (refcount 0, not free); never free. */
    assert(p->refcount[idx] > 0 || !bit_test(p, idx));
    assert(p->refcount[idx] < INT32_MAX);
    p->refcount[idx]++;
}

void kvb_block_pool_unref(kvb_block_pool *p, int32_t idx) {
    assert(idx >= 0 && idx < p->n_blocks);
    assert(p->refcount[idx] > 0);
    if (--p->refcount[idx] > 0) return;
    if (p->release && p->release(p->release_ud, idx)) return; /* held by the hook's owner */
    mark_free(p, idx);
}

int kvb_block_pool_refcount(const kvb_block_pool *p, int32_t idx) {
    assert(idx >= 0 && idx < p->capacity);
    return p->refcount[idx];
}

void kvb_block_pool_set_release_hook(kvb_block_pool *p, kvb_block_release_fn fn, void *ud) {
    p->release = fn;
    p->release_ud = fn ? ud : NULL;
}

void kvb_block_pool_free_block(kvb_block_pool *p, int32_t idx) {
    assert(idx >= 0 && idx < p->n_blocks);
    assert(p->refcount[idx] == 0 && !bit_test(p, idx)); /* held, not referenced and not free */
    mark_free(p, idx);
}

int kvb_block_pool_is_free(const kvb_block_pool *p, int32_t idx) {
    assert(idx >= 0 && idx < p->capacity);
    return idx < p->n_blocks && bit_test(p, idx);
}

kvb_status kvb_block_pool_resize(kvb_block_pool *p, int n_blocks) {
    if (n_blocks < 0 || n_blocks > p->capacity) {
        KVB_LOG_E("block pool: resize to %d blocks, capacity is %d", n_blocks, p->capacity);
        return KVB_ERR_INVALID;
    }
    if (n_blocks >= p->n_blocks) {
        for (int32_t i = p->n_blocks; i < n_blocks; i++) mark_free(p, i);
        p->n_blocks = n_blocks;
        return KVB_OK;
    }
    for (int32_t i = n_blocks; i < p->n_blocks; i++) {
        if (!bit_test(p, i)) {
            KVB_LOG_D("block pool: cannot shrink to %d blocks: block %d is %s", n_blocks, (int)i,
                      p->refcount[i] > 0 ? "referenced" : "held by the release hook");
            return KVB_ERR_STATE;
        }
    }
    for (int32_t i = n_blocks; i < p->n_blocks; i++) bit_clear(p, i);
    p->n_free -= p->n_blocks - n_blocks;
    p->n_blocks = n_blocks;
    return KVB_OK;
}
