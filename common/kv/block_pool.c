/* kvbank — block-major KV block pool (see block_pool.h).
 *
 * The free set is a bitmap with a 64-ary summary tree on top: bit i of level 0 is set when block i
 * is free; bit j of level k+1 is set when word j of level k is nonzero. Finding the lowest free block
 * descends from the single top word with count-trailing-zeros, so alloc, free and the per-block work
 * of a resize are O(log64 capacity) — at most 6 levels for 2^31 blocks.
 *
 * Ids [0, capacity) are the own memory's blocks; attached segments live above (see the id layout in
 * block_pool.h). The per-id tables (refcount, the bitmap, the attached addresses) are sized for
 * `id_cap` ids and grow by doubling when an attach needs ids past it; the segment table lists the
 * attached and retired ranges of [capacity, id_limit) in id order. */
#include "common/kv/block_pool.h"

#include <assert.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LEVELS 8 /* ceil(log64(2^31)) = 6, with room to spare */

/* A set of small integers with a 64-ary summary tree: bit i of level 0 is set when i is in the set; bit
 * j of level k+1 is set when word j of level k is nonzero. The last level has exactly one word. */
typedef struct bitmap {
    int n_levels;
    uint64_t *level[MAX_LEVELS]; /* level[k]: [n_words[k]] bits */
    size_t n_words[MAX_LEVELS];
} bitmap;

/* One range of the attached id space. */
typedef struct pool_seg {
    int32_t first;        /* first id (>= capacity) */
    int32_t n;            /* ids in the range */
    unsigned char *mem;   /* [n][block_bytes] borrowed memory while attached; NULL once retired */
} pool_seg;

struct kvb_block_pool {
    kvb_kv_geom geom;
    size_t block_bytes;   /* bytes of one block (all layers) */
    size_t layer_bytes;   /* bytes of one layer's slice of a block */
    unsigned char *mem;   /* [capacity][block_bytes] own memory, borrowed */
    size_t mem_bytes;
    int capacity;         /* most own blocks mem can hold (<= INT32_MAX) */
    int n_own;            /* own blocks currently in the pool: ids [0, n_own) */
    int n_attached;       /* blocks of attached segments */
    int id_limit;         /* ids [0, id_limit) exist: own ids, then the segments' ranges */
    int id_cap;           /* ids the per-id tables below hold (>= id_limit, >= capacity) */
    int n_free;           /* free ids (set bits of `ids`) */
    int32_t *refcount;    /* [id_cap] references per block; 0 for free, held and removed blocks */
    unsigned char **att_addr; /* [id_cap - capacity] address of block capacity+j; NULL unless attached */
    pool_seg *segs;       /* [n_segs] attached and retired ranges covering [capacity, id_limit), by id */
    int n_segs;
    int segs_cap;
    bitmap ids;           /* free ids */
    kvb_block_release_fn release;  /* may be NULL */
    void *release_ud;
    /* sliced mode (see block_pool.h); all zero / NULL in a block-major pool */
    int sliced;
    int n_slices;         /* physical slices in the pool: n_own * n_layers */
    int n_free_slices;    /* set bits of `slices` */
    int32_t *slice_of;    /* [id_cap * n_layers] physical slice of (id, layer), -1 when not resident */
    int32_t *slice_owner; /* [capacity * n_layers] the id holding each physical slice, -1 free or scratch */
    bitmap slices;        /* free physical slices, over capacity * n_layers */
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

/* ---------------------------------------------------------------- free bitmaps */

static int bit_test(const bitmap *m, int32_t i) { return (int)((m->level[0][(size_t)i >> 6] >> (i & 63)) & 1u); }

static void bit_set(bitmap *m, int32_t i) {
    size_t pos = (size_t)i;
    for (int k = 0; k < m->n_levels; k++) {
        uint64_t *w = &m->level[k][pos >> 6];
        int was_empty = (*w == 0);
        *w |= (uint64_t)1 << (pos & 63);
        if (!was_empty) break; /* the levels above already know this word is nonzero */
        pos >>= 6;
    }
}

static void bit_clear(bitmap *m, int32_t i) {
    size_t pos = (size_t)i;
    for (int k = 0; k < m->n_levels; k++) {
        uint64_t *w = &m->level[k][pos >> 6];
        *w &= ~((uint64_t)1 << (pos & 63));
        if (*w != 0) break; /* the word still has free bits: the levels above are unchanged */
        pos >>= 6;
    }
}

/* Lowest member, or -1. */
static int32_t bit_first(const bitmap *m) {
    int top = m->n_levels - 1;
    if (m->level[top][0] == 0) return -1;
    size_t pos = 0;
    for (int k = top; k >= 0; k--) pos = (pos << 6) | (size_t)__builtin_ctzll(m->level[k][pos]);
    return (int32_t)pos;
}

static void bitmap_free(bitmap *m) {
    for (int k = 0; k < m->n_levels; k++) free(m->level[k]);
    memset(m, 0, sizeof *m);
}

/* Rebuilds `m` for `bits` members, keeping the level-0 words it has (the new ones are empty) and
 * deriving the summary levels from them. On failure `m` is unchanged. */
static kvb_status bitmap_build(bitmap *m, size_t bits) {
    bitmap nm = {0};
    kvb_status st = KVB_OK;
    for (;;) {
        size_t words = (bits + 63) / 64;
        assert(nm.n_levels < MAX_LEVELS);
        nm.n_words[nm.n_levels] = words;
        KVB_TRY_GOTO(kvb_calloc(words, sizeof(uint64_t), (void **)&nm.level[nm.n_levels]), fail_levels);
        nm.n_levels++;
        if (words == 1) break;
        bits = words;
    }
    if (m->n_levels > 0) memcpy(nm.level[0], m->level[0], KVB_MIN(m->n_words[0], nm.n_words[0]) * sizeof(uint64_t));
    for (int k = 0; k + 1 < nm.n_levels; k++)
        for (size_t w = 0; w < nm.n_words[k]; w++)
            if (nm.level[k][w]) nm.level[k + 1][w >> 6] |= (uint64_t)1 << (w & 63);
    bitmap_free(m);
    *m = nm;
    return KVB_OK;
fail_levels:
    bitmap_free(&nm);
    return st;
}

static void mark_free(kvb_block_pool *p, int32_t idx) {
    bit_set(&p->ids, idx);
    p->n_free++;
}

/* Makes the per-id tables hold at least `need` ids (doubling). */
static kvb_status tables_reserve(kvb_block_pool *p, int need) {
    if (need <= p->id_cap) return KVB_OK;
    int cap = p->id_cap > INT32_MAX / 2 ? INT32_MAX : KVB_MAX(p->id_cap * 2, need);
    void *rc = p->refcount;
    KVB_TRY(kvb_realloc_array(&rc, (size_t)cap, sizeof *p->refcount));
    p->refcount = rc;
    memset(p->refcount + p->id_cap, 0, (size_t)(cap - p->id_cap) * sizeof *p->refcount);
    size_t old_att = (size_t)(p->id_cap - p->capacity), new_att = (size_t)(cap - p->capacity);
    void *att = p->att_addr;
    KVB_TRY(kvb_realloc_array(&att, new_att, sizeof *p->att_addr));
    p->att_addr = att;
    for (size_t j = old_att; j < new_att; j++) p->att_addr[j] = NULL;
    KVB_TRY(bitmap_build(&p->ids, (size_t)cap));
    p->id_cap = cap;
    return KVB_OK;
}

/* ---------------------------------------------------------------- pool */

/* Checks the arguments of a create and returns the memory's capacity in blocks (0 after logging). */
static size_t create_capacity(const kvb_kv_geom *g, void *mem, size_t mem_bytes, int n_blocks) {
    size_t bb = kvb_kv_block_bytes(g);
    if (!mem) {
        KVB_LOG_E("block pool: no memory");
        return 0;
    }
    size_t cap = mem_bytes / bb;
    if (cap > INT32_MAX) cap = INT32_MAX; /* block ids are int32 */
    if (cap == 0) {
        KVB_LOG_E("block pool: %zu bytes of memory cannot hold one block of %zu bytes", mem_bytes, bb);
        return 0;
    }
    if (n_blocks < 0 || (size_t)n_blocks > cap) {
        KVB_LOG_E("block pool: %d blocks requested, the memory holds %zu", n_blocks, cap);
        return 0;
    }
    return cap;
}

static kvb_status pool_new(const kvb_kv_geom *g, void *mem, size_t mem_bytes, size_t cap, size_t ids,
                           kvb_block_pool **out) {
    kvb_status st;
    kvb_block_pool *p = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *p, (void **)&p));
    p->geom = *g;
    p->block_bytes = kvb_kv_block_bytes(g);
    p->layer_bytes = kvb_kv_layer_bytes(g);
    p->mem = mem;
    p->mem_bytes = mem_bytes;
    p->capacity = (int)cap;
    p->id_limit = (int)ids;
    p->id_cap = (int)ids;
    KVB_TRY_GOTO(kvb_calloc(ids, sizeof *p->refcount, (void **)&p->refcount), fail_pool);
    KVB_TRY_GOTO(bitmap_build(&p->ids, ids), fail_pool);
    *out = p;
    return KVB_OK;
fail_pool:
    kvb_block_pool_destroy(p);
    return st;
}

kvb_status kvb_block_pool_create(const kvb_kv_geom *g, void *mem, size_t mem_bytes, int n_blocks,
                                 kvb_block_pool **out) {
    if (!out) return KVB_ERR_INVALID;
    *out = NULL;
    KVB_TRY(kvb_kv_geom_check(g));
    size_t cap = create_capacity(g, mem, mem_bytes, n_blocks);
    if (!cap) return KVB_ERR_INVALID;
    kvb_block_pool *p;
    KVB_TRY(pool_new(g, mem, mem_bytes, cap, cap, &p));
    for (int32_t i = 0; i < n_blocks; i++) mark_free(p, i);
    p->n_own = n_blocks;
    *out = p;
    return KVB_OK;
}

kvb_status kvb_block_pool_create_sliced(const kvb_kv_geom *g, void *mem, size_t mem_bytes, int n_blocks, int n_ids,
                                        kvb_block_pool **out) {
    if (!out) return KVB_ERR_INVALID;
    *out = NULL;
    KVB_TRY(kvb_kv_geom_check(g));
    size_t cap = create_capacity(g, mem, mem_bytes, n_blocks);
    if (!cap) return KVB_ERR_INVALID;
    size_t L = (size_t)g->n_layers;
    if (n_ids < 1 || cap > INT32_MAX / L || (size_t)n_ids > SIZE_MAX / L / sizeof(int32_t)) {
        KVB_LOG_E("block pool: a sliced pool of %zu blocks x %zu layers and %d ids is out of range", cap, L, n_ids);
        return KVB_ERR_INVALID;
    }
    kvb_status st;
    kvb_block_pool *p;
    KVB_TRY(pool_new(g, mem, mem_bytes, cap, (size_t)n_ids, &p));
    p->sliced = 1;
    KVB_TRY_GOTO(kvb_malloc((size_t)n_ids * L * sizeof *p->slice_of, (void **)&p->slice_of), fail_pool);
    for (size_t i = 0; i < (size_t)n_ids * L; i++) p->slice_of[i] = -1;
    KVB_TRY_GOTO(bitmap_build(&p->slices, cap * L), fail_pool);
    KVB_TRY_GOTO(kvb_malloc(cap * L * sizeof *p->slice_owner, (void **)&p->slice_owner), fail_pool);
    for (size_t k = 0; k < cap * L; k++) p->slice_owner[k] = -1;
    for (int32_t i = 0; i < n_ids; i++) mark_free(p, i);
    for (int32_t k = 0; k < (int32_t)((size_t)n_blocks * L); k++) bit_set(&p->slices, k);
    p->n_slices = p->n_free_slices = (int)((size_t)n_blocks * L);
    p->n_own = n_blocks;
    *out = p;
    return KVB_OK;
fail_pool:
    kvb_block_pool_destroy(p);
    return st;
}

void kvb_block_pool_destroy(kvb_block_pool *p) {
    if (!p) return;
    bitmap_free(&p->ids);
    bitmap_free(&p->slices);
    free(p->slice_of);
    free(p->slice_owner);
    free(p->refcount);
    free(p->att_addr);
    free(p->segs);
    free(p);
}

const kvb_kv_geom *kvb_block_pool_geom(const kvb_block_pool *p) { return &p->geom; }
int kvb_block_pool_n_blocks(const kvb_block_pool *p) { return p->n_own + p->n_attached; }
int kvb_block_pool_is_sliced(const kvb_block_pool *p) { return p->sliced; }
int kvb_block_pool_n_slices(const kvb_block_pool *p) { return p->n_slices; }
int kvb_block_pool_n_free_slices(const kvb_block_pool *p) { return p->n_free_slices; }
int kvb_block_pool_n_own(const kvb_block_pool *p) { return p->n_own; }
int kvb_block_pool_n_attached(const kvb_block_pool *p) { return p->n_attached; }
int kvb_block_pool_capacity(const kvb_block_pool *p) { return p->capacity; }
int kvb_block_pool_id_limit(const kvb_block_pool *p) { return p->id_limit; }
int kvb_block_pool_n_free_ids(const kvb_block_pool *p) { return p->n_free; }

int kvb_block_pool_n_free(const kvb_block_pool *p) {
    return p->sliced ? KVB_MIN(p->n_free, p->n_free_slices / p->geom.n_layers) : p->n_free;
}

int kvb_block_pool_has(const kvb_block_pool *p, int32_t idx) {
    if (idx < 0 || idx >= p->id_limit) return 0;
    if (p->sliced) return 1;
    if (idx < p->capacity) return idx < p->n_own;
    return p->att_addr[idx - p->capacity] != NULL;
}

int kvb_block_pool_is_attached(const kvb_block_pool *p, int32_t idx) { return !p->sliced && idx >= p->capacity; }

void *kvb_block_pool_block(const kvb_block_pool *p, int32_t idx) {
    assert(!p->sliced); /* a sliced block has no address of its own: its layers live apart */
    assert(idx >= 0 && idx < p->id_limit);
    if (idx < p->capacity) return p->mem + (size_t)idx * p->block_bytes;
    assert(p->att_addr[idx - p->capacity]);
    return p->att_addr[idx - p->capacity];
}

void *kvb_block_pool_block_layer(const kvb_block_pool *p, int32_t idx, int layer) {
    assert(layer >= 0 && layer < p->geom.n_layers);
    if (p->sliced) {
        int32_t k = p->slice_of[(size_t)idx * (size_t)p->geom.n_layers + (size_t)layer];
        assert(k >= 0); /* resident */
        return kvb_block_pool_slice_addr(p, k);
    }
    return (unsigned char *)kvb_block_pool_block(p, idx) + (size_t)layer * p->layer_bytes;
}

/* Sliced: gives (idx, layer) the lowest free physical slice (there is one). */
static void slice_take(kvb_block_pool *p, int32_t idx, int layer) {
    int32_t *so = &p->slice_of[(size_t)idx * (size_t)p->geom.n_layers + (size_t)layer];
    assert(*so < 0);
    int32_t k = bit_first(&p->slices);
    assert(k >= 0);
    bit_clear(&p->slices, k);
    p->n_free_slices--;
    *so = k;
    p->slice_owner[k] = idx;
}

/* Sliced: returns every slice of idx. */
static void slices_release(kvb_block_pool *p, int32_t idx) {
    int32_t *so = &p->slice_of[(size_t)idx * (size_t)p->geom.n_layers];
    for (int l = 0; l < p->geom.n_layers; l++) {
        if (so[l] < 0) continue;
        bit_set(&p->slices, so[l]);
        p->slice_owner[so[l]] = -1;
        p->n_free_slices++;
        so[l] = -1;
    }
}

/* Takes free id idx, refcount 1; sliced: with every layer resident when `full`. */
static void take_id(kvb_block_pool *p, int32_t idx, int full) {
    bit_clear(&p->ids, idx);
    p->n_free--;
    p->refcount[idx] = 1;
    if (p->sliced && full)
        for (int l = 0; l < p->geom.n_layers; l++) slice_take(p, idx, l);
}

kvb_status kvb_block_pool_alloc(kvb_block_pool *p, int32_t *out) {
    int32_t idx = bit_first(&p->ids);
    if (idx < 0 || (p->sliced && p->n_free_slices < p->geom.n_layers)) return KVB_ERR_EXHAUSTED;
    assert(kvb_block_pool_has(p, idx) && p->refcount[idx] == 0);
    take_id(p, idx, 1);
    *out = idx;
    return KVB_OK;
}

kvb_status kvb_block_pool_alloc_bare(kvb_block_pool *p, int32_t *out) {
    if (!p->sliced) return KVB_ERR_UNSUPPORTED;
    int32_t idx = bit_first(&p->ids);
    if (idx < 0) return KVB_ERR_EXHAUSTED;
    take_id(p, idx, 0);
    *out = idx;
    return KVB_OK;
}

kvb_status kvb_block_pool_take(kvb_block_pool *p, int32_t idx) {
    if (!kvb_block_pool_is_free(p, idx)) return KVB_ERR_STATE;
    if (p->sliced && p->n_free_slices < p->geom.n_layers) return KVB_ERR_EXHAUSTED;
    take_id(p, idx, 1);
    return KVB_OK;
}

int kvb_block_pool_slice_resident(const kvb_block_pool *p, int32_t idx, int layer) {
    assert(p->sliced && idx >= 0 && idx < p->id_limit && layer >= 0 && layer < p->geom.n_layers);
    return p->slice_of[(size_t)idx * (size_t)p->geom.n_layers + (size_t)layer] >= 0;
}

int32_t kvb_block_pool_slice_owner(const kvb_block_pool *p, int32_t slice) {
    assert(p->sliced && slice >= 0 && slice < p->capacity * p->geom.n_layers);
    return p->slice_owner[slice];
}

int kvb_block_pool_free_tail(const kvb_block_pool *p) {
    int n = 0;
    if (p->sliced) { /* slices free or held by an unreferenced block (a cached prefix block) */
        int L = p->geom.n_layers;
        for (int b = p->n_own - 1; b >= 0; b--) {
            int all = 1;
            for (int l = 0; l < L && all; l++) {
                int32_t k = b * L + l, o = p->slice_owner[k];
                all = bit_test(&p->slices, k) || (o >= 0 && p->refcount[o] == 0);
            }
            if (!all) break;
            n++;
        }
        return n;
    }
    for (int32_t i = p->n_own - 1; i >= 0 && bit_test(&p->ids, i); i--) n++;
    return n;
}

int64_t kvb_block_pool_referenced_slices(const kvb_block_pool *p) {
    if (!p->sliced) return 0;
    int64_t n = 0;
    for (int32_t i = 0; i < p->id_limit; i++)
        if (p->refcount[i] > 0) n += kvb_block_pool_n_resident(p, i);
    return n;
}

int kvb_block_pool_n_resident(const kvb_block_pool *p, int32_t idx) {
    if (!p->sliced) return p->geom.n_layers;
    int n = 0;
    for (int l = 0; l < p->geom.n_layers; l++) n += kvb_block_pool_slice_resident(p, idx, l);
    return n;
}

kvb_status kvb_block_pool_slice_alloc(kvb_block_pool *p, int32_t idx, int layer) {
    assert(p->sliced && (p->refcount[idx] > 0 || !bit_test(&p->ids, idx))); /* referenced or held */
    if (kvb_block_pool_slice_resident(p, idx, layer)) return KVB_OK;
    if (p->n_free_slices == 0) return KVB_ERR_EXHAUSTED;
    slice_take(p, idx, layer);
    return KVB_OK;
}

void kvb_block_pool_slice_free(kvb_block_pool *p, int32_t idx, int layer) {
    int32_t *so = &p->slice_of[(size_t)idx * (size_t)p->geom.n_layers + (size_t)layer];
    assert(p->sliced && *so >= 0);
    bit_set(&p->slices, *so);
    p->slice_owner[*so] = -1;
    p->n_free_slices++;
    *so = -1;
}

kvb_status kvb_block_pool_scratch_alloc(kvb_block_pool *p, int32_t *slice) {
    if (!p->sliced) return KVB_ERR_UNSUPPORTED;
    int32_t k = bit_first(&p->slices);
    if (k < 0) return KVB_ERR_EXHAUSTED;
    bit_clear(&p->slices, k);
    p->n_free_slices--;
    *slice = k;
    return KVB_OK;
}

void kvb_block_pool_scratch_free(kvb_block_pool *p, int32_t slice) {
    assert(p->sliced && slice >= 0 && slice < p->capacity * p->geom.n_layers && !bit_test(&p->slices, slice));
    bit_set(&p->slices, slice);
    p->n_free_slices++;
}

void *kvb_block_pool_slice_addr(const kvb_block_pool *p, int32_t slice) {
    assert(p->sliced && slice >= 0 && slice < p->capacity * p->geom.n_layers);
    return p->mem + (size_t)slice * p->layer_bytes;
}

void kvb_block_pool_ref(kvb_block_pool *p, int32_t idx) {
    assert(kvb_block_pool_has(p, idx));
    /* A block is referenced, or held by the release hook (refcount 0, not free); never free. */
    assert(p->refcount[idx] > 0 || !bit_test(&p->ids, idx));
    assert(p->refcount[idx] < INT32_MAX);
    p->refcount[idx]++;
}

void kvb_block_pool_unref(kvb_block_pool *p, int32_t idx) {
    assert(kvb_block_pool_has(p, idx));
    assert(p->refcount[idx] > 0);
    if (--p->refcount[idx] > 0) return;
    if (p->release && p->release(p->release_ud, idx)) return; /* held by the hook's owner */
    mark_free(p, idx);
    if (p->sliced) slices_release(p, idx);
}

int kvb_block_pool_refcount(const kvb_block_pool *p, int32_t idx) {
    assert(idx >= 0 && idx < p->id_limit);
    return p->refcount[idx];
}

void kvb_block_pool_set_release_hook(kvb_block_pool *p, kvb_block_release_fn fn, void *ud) {
    p->release = fn;
    p->release_ud = fn ? ud : NULL;
}

void kvb_block_pool_free_block(kvb_block_pool *p, int32_t idx) {
    assert(kvb_block_pool_has(p, idx));
    assert(p->refcount[idx] == 0 && !bit_test(&p->ids, idx)); /* held, not referenced and not free */
    mark_free(p, idx);
    if (p->sliced) slices_release(p, idx);
}

int kvb_block_pool_is_free(const kvb_block_pool *p, int32_t idx) {
    if (idx < 0) return 0;
    /* only blocks of the pool have their bit set: removed own ids and retired ranges never do */
    return idx < p->id_limit && bit_test(&p->ids, idx);
}

/* Sliced: the physical slices of own blocks [n_blocks, n_own) leave (all free) or [n_own, n_blocks) join. */
static kvb_status resize_sliced(kvb_block_pool *p, int n_blocks) {
    int L = p->geom.n_layers;
    if (n_blocks >= p->n_own) {
        for (int32_t k = p->n_own * L; k < n_blocks * L; k++) bit_set(&p->slices, k);
    } else {
        for (int32_t k = n_blocks * L; k < p->n_own * L; k++) {
            if (!bit_test(&p->slices, k)) {
                KVB_LOG_D("block pool: cannot shrink to %d blocks: slice %d is in use", n_blocks, (int)k);
                return KVB_ERR_STATE;
            }
        }
        for (int32_t k = n_blocks * L; k < p->n_own * L; k++) bit_clear(&p->slices, k);
    }
    p->n_free_slices += (n_blocks - p->n_own) * L;
    p->n_slices = n_blocks * L;
    p->n_own = n_blocks;
    return KVB_OK;
}

kvb_status kvb_block_pool_resize(kvb_block_pool *p, int n_blocks) {
    if (n_blocks < 0 || n_blocks > p->capacity) {
        KVB_LOG_E("block pool: resize to %d own blocks, capacity is %d", n_blocks, p->capacity);
        return KVB_ERR_INVALID;
    }
    if (p->sliced) return resize_sliced(p, n_blocks);
    if (n_blocks >= p->n_own) {
        for (int32_t i = p->n_own; i < n_blocks; i++) mark_free(p, i);
        p->n_own = n_blocks;
        return KVB_OK;
    }
    for (int32_t i = n_blocks; i < p->n_own; i++) {
        if (!bit_test(&p->ids, i)) {
            KVB_LOG_D("block pool: cannot shrink to %d blocks: block %d is %s", n_blocks, (int)i,
                      p->refcount[i] > 0 ? "referenced" : "held by the release hook");
            return KVB_ERR_STATE;
        }
    }
    for (int32_t i = n_blocks; i < p->n_own; i++) bit_clear(&p->ids, i);
    p->n_free -= p->n_own - n_blocks;
    p->n_own = n_blocks;
    return KVB_OK;
}

/* ---------------------------------------------------------------- segments */

/* Makes room for one more entry in the segment table. */
static kvb_status segs_reserve(kvb_block_pool *p) {
    if (p->n_segs < p->segs_cap) return KVB_OK;
    int cap = p->segs_cap ? 2 * p->segs_cap : 8;
    void *segs = p->segs;
    KVB_TRY(kvb_realloc_array(&segs, (size_t)cap, sizeof *p->segs));
    p->segs = segs;
    p->segs_cap = cap;
    return KVB_OK;
}

static void segs_insert(kvb_block_pool *p, int at, pool_seg s) {
    assert(p->n_segs < p->segs_cap);
    memmove(&p->segs[at + 1], &p->segs[at], (size_t)(p->n_segs - at) * sizeof *p->segs);
    p->segs[at] = s;
    p->n_segs++;
}

static void segs_remove(kvb_block_pool *p, int at) {
    memmove(&p->segs[at], &p->segs[at + 1], (size_t)(p->n_segs - at - 1) * sizeof *p->segs);
    p->n_segs--;
}

kvb_status kvb_block_pool_attach(kvb_block_pool *p, void *mem, int n, int32_t *first_id) {
    if (!p || !mem || n < 1 || !first_id) {
        KVB_LOG_E("block pool: attach needs memory and at least one block (%d)", n);
        return KVB_ERR_INVALID;
    }
    if (p->sliced) {
        KVB_LOG_E("block pool: a sliced pool cannot attach borrowed memory");
        return KVB_ERR_UNSUPPORTED;
    }
    KVB_TRY(segs_reserve(p)); /* a split or an append adds at most one entry */
    /* first fit over the retired ranges */
    int at = -1;
    for (int i = 0; i < p->n_segs; i++) {
        if (!p->segs[i].mem && p->segs[i].n >= n) {
            at = i;
            break;
        }
    }
    pool_seg seg = {.n = n, .mem = mem};
    if (at >= 0) {
        seg.first = p->segs[at].first;
        if (p->segs[at].n > n) {
            pool_seg rest = {.first = seg.first + n, .n = p->segs[at].n - n, .mem = NULL};
            p->segs[at] = seg;
            segs_insert(p, at + 1, rest);
        } else {
            p->segs[at] = seg;
        }
    } else {
        if (n > INT32_MAX - p->id_limit) {
            KVB_LOG_E("block pool: attaching %d blocks would pass the id space (%d ids in use)", n, p->id_limit);
            return KVB_ERR_INVALID;
        }
        KVB_TRY(tables_reserve(p, p->id_limit + n));
        seg.first = p->id_limit;
        segs_insert(p, p->n_segs, seg);
        p->id_limit += n;
    }
    for (int32_t j = 0; j < n; j++) {
        int32_t idx = seg.first + j;
        p->att_addr[idx - p->capacity] = (unsigned char *)mem + (size_t)j * p->block_bytes;
        assert(p->refcount[idx] == 0 && !bit_test(&p->ids, idx));
        mark_free(p, idx);
    }
    p->n_attached += n;
    *first_id = seg.first;
    return KVB_OK;
}

kvb_status kvb_block_pool_detach(kvb_block_pool *p, int32_t first_id, int n) {
    if (!p) return KVB_ERR_INVALID;
    if (p->sliced) return KVB_ERR_UNSUPPORTED;
    int at = -1;
    for (int i = 0; i < p->n_segs; i++) {
        if (p->segs[i].first == first_id) {
            at = i;
            break;
        }
    }
    if (at < 0 || !p->segs[at].mem || n < 1 || p->segs[at].n < n) {
        KVB_LOG_E("block pool: [%d, +%d) is not the start of an attached segment", (int)first_id, n);
        return KVB_ERR_INVALID;
    }
    for (int32_t idx = first_id; idx < first_id + n; idx++) {
        if (!bit_test(&p->ids, idx)) {
            KVB_LOG_D("block pool: cannot detach [%d, +%d): block %d is %s", (int)first_id, n, (int)idx,
                      p->refcount[idx] > 0 ? "referenced" : "held by the release hook");
            return KVB_ERR_STATE;
        }
    }
    if (p->segs[at].n > n) { /* the front of the segment: the rest stays attached as a segment of its own */
        KVB_TRY(segs_reserve(p));
        pool_seg rest = {.first = first_id + n, .n = p->segs[at].n - n,
                         .mem = p->segs[at].mem + (size_t)n * p->block_bytes};
        p->segs[at].n = n;
        segs_insert(p, at + 1, rest);
    }
    for (int32_t idx = first_id; idx < first_id + n; idx++) {
        bit_clear(&p->ids, idx);
        p->att_addr[idx - p->capacity] = NULL;
    }
    p->n_free -= n;
    p->n_attached -= n;
    p->segs[at].mem = NULL;
    /* merge with retired neighbours, then trim a retired range at the top of the id space */
    if (at + 1 < p->n_segs && !p->segs[at + 1].mem) {
        p->segs[at].n += p->segs[at + 1].n;
        segs_remove(p, at + 1);
    }
    if (at > 0 && !p->segs[at - 1].mem) {
        p->segs[at - 1].n += p->segs[at].n;
        segs_remove(p, at);
        at--;
    }
    if (at == p->n_segs - 1) {
        p->id_limit = p->segs[at].first;
        segs_remove(p, at);
    }
    return KVB_OK;
}
