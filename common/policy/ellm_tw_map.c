/* kvbank — eLLM's map table (§3.2): F-layer units packed into slots of block-major pool blocks. */
#include "common/policy/ellm_tw_map.h"

#include <string.h>

/* ---------------------------------------------------------------- unit geometry */
int kvb_etw_map_unit_layers(int n_layers, int F) { return F < n_layers ? F : n_layers; }

int kvb_etw_map_slots(int n_layers, int F) { return n_layers / kvb_etw_map_unit_layers(n_layers, F); }

int kvb_etw_map_groups(int n_layers, int F) { return KVB_DIV_CEIL(n_layers, kvb_etw_map_unit_layers(n_layers, F)); }

int kvb_etw_map_units_span(int n_layers, int F, int lo, int hi) {
    int f = kvb_etw_map_unit_layers(n_layers, F);
    if (lo < 0) lo = 0;
    if (hi > n_layers) hi = n_layers;
    if (hi <= lo) return 0;
    return (hi - 1) / f - lo / f + 1;
}

int kvb_etw_map_units_window(int n_layers, int F, int depth) {
    int f = kvb_etw_map_unit_layers(n_layers, F), groups = kvb_etw_map_groups(n_layers, F);
    if (depth <= 0) return 0;
    int w = KVB_DIV_CEIL(depth - 1, f) + 1; /* a window of depth layers starting anywhere */
    return w < groups ? w : groups;
}

int64_t kvb_etw_map_carriers(int n_layers, int F, int depth, int64_t token_blocks) {
    int64_t units = token_blocks * kvb_etw_map_units_window(n_layers, F, depth);
    return KVB_DIV_CEIL(units, (int64_t)kvb_etw_map_slots(n_layers, F));
}

int64_t kvb_etw_map_host_carriers(int n_layers, int F, int n_rec, int64_t token_blocks) {
    int64_t units = token_blocks * kvb_etw_map_units_span(n_layers, F, n_rec, n_layers);
    return KVB_DIV_CEIL(units, (int64_t)kvb_etw_map_slots(n_layers, F));
}

/* ---------------------------------------------------------------- the table */
typedef struct bucket {
    uint64_t seq;
    int32_t tb;      /* token block */
    int16_t g;       /* layer group */
    uint8_t used;
    int32_t carrier; /* index into carriers */
    int16_t slot;
    int32_t filled;
} bucket;

typedef struct carrier {
    int32_t block;     /* pool block id; -1: this index is unused */
    int n_used;        /* slots in use */
    int free_full;     /* full slots free */
    uint8_t in_full;   /* on the full-slot stack */
    uint8_t in_short;  /* on the short-slot stack */
} carrier;

struct kvb_etw_map {
    int L, F, bs;
    int groups, full_slots, n_slots; /* n_slots = full_slots (+1 short) */
    int short_len;                   /* layers of the short slot (0: none) */
    kvb_etw_map_blocks prov;

    bucket *tab;    /* open addressing, backward-shift deletion */
    int64_t cap;    /* power of two */
    int64_t n;

    carrier *car;    /* [car_cap] */
    int32_t *slot_b; /* [car_cap][n_slots] bucket index or -1 */
    int car_cap, car_n; /* car_n: indices handed out so far */
    int32_t *idle;   /* stack of unused carrier indices */
    int n_idle;
    int32_t *st_full, *st_short; /* stacks of carriers that may have a free full / short slot */
    int n_full, n_short;

    int64_t carriers_held, carrier_allocs, lookups;
    double used_tl;  /* Σ filled × unit layers */
};

static int unit_len(const kvb_etw_map *m, int g) {
    int l = m->L - g * m->F;
    return l < m->F ? l : m->F;
}

static int slot_len(const kvb_etw_map *m, int k) { return k < m->full_slots ? m->F : m->short_len; }

static uint64_t hash_key(uint64_t seq, int32_t tb, int g) {
    uint64_t h = seq * 0x9E3779B97F4A7C15ull ^ ((uint64_t)(uint32_t)tb * 0xC2B2AE3D27D4EB4Full) ^ ((uint64_t)g << 48);
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return h;
}

static int64_t find(const kvb_etw_map *m, uint64_t seq, int32_t tb, int g) {
    if (!m->cap) return -1;
    int64_t mask = m->cap - 1, i = (int64_t)(hash_key(seq, tb, g) & (uint64_t)mask);
    for (;;) {
        const bucket *b = &m->tab[i];
        if (!b->used) return -1;
        if (b->seq == seq && b->tb == tb && b->g == g) return i;
        i = (i + 1) & mask;
    }
}

static kvb_status grow_table(kvb_etw_map *m) {
    int64_t ncap = m->cap ? m->cap * 2 : 64;
    bucket *nt;
    KVB_TRY(kvb_calloc((size_t)ncap, sizeof *nt, (void **)&nt));
    for (int64_t i = 0; i < m->cap; i++) {
        bucket *b = &m->tab[i];
        if (!b->used) continue;
        int64_t j = (int64_t)(hash_key(b->seq, b->tb, b->g) & (uint64_t)(ncap - 1));
        while (nt[j].used) j = (j + 1) & (ncap - 1);
        nt[j] = *b;
        m->slot_b[(int64_t)b->carrier * m->n_slots + b->slot] = (int32_t)j;
    }
    free(m->tab);
    m->tab = nt;
    m->cap = ncap;
    return KVB_OK;
}

static kvb_status grow_carriers(kvb_etw_map *m) {
    int ncap = m->car_cap ? m->car_cap * 2 : 16;
    carrier *nc = m->car;
    int32_t *ns = m->slot_b, *ni = m->idle, *nf = m->st_full, *nsh = m->st_short;
    KVB_TRY(kvb_realloc_array((void **)&nc, (size_t)ncap, sizeof *nc));
    m->car = nc;
    KVB_TRY(kvb_realloc_array((void **)&ns, (size_t)ncap * m->n_slots, sizeof *ns));
    m->slot_b = ns;
    KVB_TRY(kvb_realloc_array((void **)&ni, (size_t)ncap, sizeof *ni));
    m->idle = ni;
    /* a carrier is on each stack at most once (the in_* flags), so car_cap entries suffice */
    KVB_TRY(kvb_realloc_array((void **)&nf, (size_t)ncap, sizeof *nf));
    m->st_full = nf;
    KVB_TRY(kvb_realloc_array((void **)&nsh, (size_t)ncap, sizeof *nsh));
    m->st_short = nsh;
    m->car_cap = ncap;
    return KVB_OK;
}

kvb_status kvb_etw_map_create(int n_layers, int F, int block_size, const kvb_etw_map_blocks *blocks,
                              kvb_etw_map **out) {
    if (n_layers < 1 || F < 1 || block_size < 1 || !blocks || !blocks->alloc || !blocks->free) {
        KVB_LOG_E("map table: bad geometry (L %d, F %d, bs %d) or block provider", n_layers, F, block_size);
        return KVB_ERR_INVALID;
    }
    kvb_etw_map *m;
    KVB_TRY(kvb_calloc(1, sizeof *m, (void **)&m));
    m->L = n_layers;
    m->F = kvb_etw_map_unit_layers(n_layers, F);
    m->bs = block_size;
    m->groups = kvb_etw_map_groups(n_layers, F);
    m->full_slots = n_layers / m->F;
    m->short_len = n_layers % m->F;
    m->n_slots = m->full_slots + (m->short_len ? 1 : 0);
    m->prov = *blocks;
    *out = m;
    return KVB_OK;
}

void kvb_etw_map_clear(kvb_etw_map *m) {
    if (!m) return;
    for (int c = 0; c < m->car_n; c++)
        if (m->car[c].block >= 0) m->prov.free(m->prov.ud, m->car[c].block);
    if (m->tab) memset(m->tab, 0, (size_t)m->cap * sizeof *m->tab);
    m->n = 0;
    m->car_n = m->n_idle = m->n_full = m->n_short = 0;
    m->carriers_held = 0;
    m->used_tl = 0;
}

void kvb_etw_map_destroy(kvb_etw_map *m) {
    if (!m) return;
    kvb_etw_map_clear(m);
    free(m->tab);
    free(m->car);
    free(m->slot_b);
    free(m->idle);
    free(m->st_full);
    free(m->st_short);
    free(m);
}

int kvb_etw_map_groups_of(const kvb_etw_map *m) { return m->groups; }
int kvb_etw_map_slots_of(const kvb_etw_map *m) { return m->n_slots; }

static void push_full(kvb_etw_map *m, int c) {
    if (m->car[c].in_full) return;
    m->car[c].in_full = 1;
    m->st_full[m->n_full++] = c;
}

static void push_short(kvb_etw_map *m, int c) {
    if (m->car[c].in_short) return;
    m->car[c].in_short = 1;
    m->st_short[m->n_short++] = c;
}

/* A carrier with a free slot of at least `len` layers: the short slot first for a short unit. Stale
 * stack entries (full or returned carriers) are dropped as they surface. Returns -1 if none. */
static int find_carrier(kvb_etw_map *m, int len, int *slot) {
    if (m->short_len && len <= m->short_len) {
        while (m->n_short) {
            int c = m->st_short[m->n_short - 1];
            int k = m->full_slots;
            if (m->car[c].block >= 0 && m->slot_b[(int64_t)c * m->n_slots + k] < 0) {
                *slot = k;
                return c;
            }
            m->car[c].in_short = 0;
            m->n_short--;
        }
    }
    while (m->n_full) {
        int c = m->st_full[m->n_full - 1];
        if (m->car[c].block >= 0 && m->car[c].free_full > 0) {
            for (int k = 0; k < m->full_slots; k++)
                if (m->slot_b[(int64_t)c * m->n_slots + k] < 0) {
                    *slot = k;
                    return c;
                }
        }
        m->car[c].in_full = 0;
        m->n_full--;
    }
    return -1;
}

static kvb_status new_carrier(kvb_etw_map *m, int *out) {
    if (!m->n_idle && m->car_n == m->car_cap) KVB_TRY(grow_carriers(m));
    int32_t block;
    KVB_TRY(m->prov.alloc(m->prov.ud, &block));
    int reused = m->n_idle > 0;
    int c = reused ? m->idle[--m->n_idle] : m->car_n++;
    /* a returned carrier's index may still sit on the stacks (entries are dropped lazily): keep its
     * flags, so that it is never pushed twice and the stacks never outgrow car_cap */
    uint8_t in_full = reused ? m->car[c].in_full : 0, in_short = reused ? m->car[c].in_short : 0;
    m->car[c] = (carrier){.block = block, .n_used = 0, .free_full = m->full_slots, .in_full = in_full,
                          .in_short = in_short};
    for (int k = 0; k < m->n_slots; k++) m->slot_b[(int64_t)c * m->n_slots + k] = -1;
    push_full(m, c);
    if (m->short_len) push_short(m, c);
    m->carriers_held++;
    m->carrier_allocs++;
    *out = c;
    return KVB_OK;
}

kvb_status kvb_etw_map_add(kvb_etw_map *m, uint64_t seq, int32_t token_block, int g, int filled) {
    if (g < 0 || g >= m->groups || token_block < 0 || filled < 0 || filled > m->bs) return KVB_ERR_INVALID;
    if (find(m, seq, token_block, g) >= 0) return KVB_ERR_STATE;
    if ((m->n + 1) * 2 > m->cap) KVB_TRY(grow_table(m));
    int len = unit_len(m, g), slot = -1;
    int c = find_carrier(m, len, &slot);
    if (c < 0) {
        KVB_TRY(new_carrier(m, &c));
        c = find_carrier(m, len, &slot);
    }
    int64_t mask = m->cap - 1, i = (int64_t)(hash_key(seq, token_block, g) & (uint64_t)mask);
    while (m->tab[i].used) i = (i + 1) & mask;
    m->tab[i] = (bucket){.seq = seq, .tb = token_block, .g = (int16_t)g, .used = 1, .carrier = c,
                         .slot = (int16_t)slot, .filled = filled};
    m->n++;
    m->slot_b[(int64_t)c * m->n_slots + slot] = (int32_t)i;
    m->car[c].n_used++;
    if (slot < m->full_slots) m->car[c].free_full--;
    m->used_tl += (double)filled * len;
    return KVB_OK;
}

kvb_status kvb_etw_map_set_filled(kvb_etw_map *m, uint64_t seq, int32_t token_block, int g, int filled) {
    if (filled < 0 || filled > m->bs) return KVB_ERR_INVALID;
    int64_t i = find(m, seq, token_block, g);
    if (i < 0) return KVB_ERR_NOT_FOUND;
    m->used_tl += (double)(filled - m->tab[i].filled) * unit_len(m, g);
    m->tab[i].filled = filled;
    return KVB_OK;
}

kvb_status kvb_etw_map_lookup(kvb_etw_map *m, uint64_t seq, int32_t token_block, int layer, kvb_etw_map_loc *out) {
    m->lookups++;
    if (layer < 0 || layer >= m->L) return KVB_ERR_INVALID;
    int g = layer / m->F;
    int64_t i = find(m, seq, token_block, g);
    if (i < 0) return KVB_ERR_NOT_FOUND;
    const bucket *b = &m->tab[i];
    out->block = m->car[b->carrier].block;
    out->layer = b->slot * m->F + (layer - g * m->F);
    return KVB_OK;
}

kvb_status kvb_etw_map_entry_of(const kvb_etw_map *m, uint64_t seq, int32_t token_block, int g,
                                kvb_etw_map_entry *out) {
    int64_t i = find(m, seq, token_block, g);
    if (i < 0) return KVB_ERR_NOT_FOUND;
    const bucket *b = &m->tab[i];
    *out = (kvb_etw_map_entry){
        .seq_id = seq,
        .token_id = token_block * m->bs,
        .layer_id = g * m->F,
        .logical_block_id = token_block * m->groups + g,
        .physical_block_id = m->car[b->carrier].block * m->n_slots + b->slot,
        .filled = b->filled,
    };
    return KVB_OK;
}

/* Removes bucket i with backward-shift deletion, keeping slot_b pointing at moved buckets. */
static void erase_bucket(kvb_etw_map *m, int64_t i) {
    int64_t mask = m->cap - 1, j = i;
    m->tab[i].used = 0;
    for (;;) {
        j = (j + 1) & mask;
        if (!m->tab[j].used) break;
        int64_t home = (int64_t)(hash_key(m->tab[j].seq, m->tab[j].tb, m->tab[j].g) & (uint64_t)mask);
        /* move j into the hole at i if its home is not in (i, j] cyclically */
        int in_range = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (in_range) continue;
        m->tab[i] = m->tab[j];
        m->slot_b[(int64_t)m->tab[i].carrier * m->n_slots + m->tab[i].slot] = (int32_t)i;
        m->tab[j].used = 0;
        i = j;
    }
}

static void unmap_bucket(kvb_etw_map *m, int64_t i) {
    bucket b = m->tab[i];
    carrier *c = &m->car[b.carrier];
    m->slot_b[(int64_t)b.carrier * m->n_slots + b.slot] = -1;
    m->used_tl -= (double)b.filled * unit_len(m, b.g);
    erase_bucket(m, i);
    m->n--;
    c->n_used--;
    if (b.slot < m->full_slots) c->free_full++;
    if (c->n_used == 0) {
        m->prov.free(m->prov.ud, c->block);
        c->block = -1; /* stale stack entries are dropped lazily */
        m->idle[m->n_idle++] = b.carrier;
        m->carriers_held--;
        return;
    }
    if (b.slot < m->full_slots) push_full(m, b.carrier);
    else push_short(m, b.carrier);
}

kvb_status kvb_etw_map_remove(kvb_etw_map *m, uint64_t seq, int32_t token_block, int g) {
    int64_t i = find(m, seq, token_block, g);
    if (i < 0) return KVB_ERR_NOT_FOUND;
    unmap_bucket(m, i);
    return KVB_OK;
}

int kvb_etw_map_remove_seq(kvb_etw_map *m, uint64_t seq) {
    int removed = 0;
    /* Every bucket of seq before i is gone; a backward shift only moves a bucket into the hole just
     * made at i (from later, or wrapped from the start of the table), so i is looked at again. */
    for (int64_t i = 0; i < m->cap;) {
        if (m->tab[i].used && m->tab[i].seq == seq) {
            unmap_bucket(m, i);
            removed++;
        } else {
            i++;
        }
    }
    return removed;
}

void kvb_etw_map_get_stats(const kvb_etw_map *m, kvb_etw_map_stats *out) {
    *out = (kvb_etw_map_stats){
        .units = m->n,
        .carriers = m->carriers_held,
        .carrier_allocs = m->carrier_allocs,
        .lookups = m->lookups,
        .used_bytes = m->used_tl,
        .held_bytes = (double)m->carriers_held * m->L * m->bs,
    };
}

kvb_status kvb_etw_map_check(const kvb_etw_map *m) {
    int64_t seen = 0, held = 0;
    double used = 0;
    for (int c = 0; c < m->car_n; c++) {
        const carrier *cr = &m->car[c];
        if (cr->block < 0) continue;
        held++;
        int n_used = 0, free_full = 0;
        for (int k = 0; k < m->n_slots; k++) {
            int32_t bi = m->slot_b[(int64_t)c * m->n_slots + k];
            if (bi < 0) {
                if (k < m->full_slots) free_full++;
                continue;
            }
            n_used++;
            const bucket *b = &m->tab[bi];
            if (!b->used || b->carrier != c || b->slot != k) {
                KVB_LOG_E("map table: slot %d of carrier %d points at bucket %d that is not its unit", k, c, bi);
                return KVB_ERR_STATE;
            }
            if (unit_len(m, b->g) > slot_len(m, k)) {
                KVB_LOG_E("map table: unit of %d layers in a slot of %d", unit_len(m, b->g), slot_len(m, k));
                return KVB_ERR_STATE;
            }
        }
        if (n_used == 0 || n_used != cr->n_used || free_full != cr->free_full) {
            KVB_LOG_E("map table: carrier %d (block %d) counts %d used / %d free, slots say %d / %d", c, cr->block,
                      cr->n_used, cr->free_full, n_used, free_full);
            return KVB_ERR_STATE;
        }
        for (int c2 = c + 1; c2 < m->car_n; c2++)
            if (m->car[c2].block == cr->block) {
                KVB_LOG_E("map table: block %d held twice", cr->block);
                return KVB_ERR_STATE;
            }
    }
    for (int64_t i = 0; i < m->cap; i++) {
        const bucket *b = &m->tab[i];
        if (!b->used) continue;
        seen++;
        if (b->carrier < 0 || b->carrier >= m->car_n || m->car[b->carrier].block < 0 ||
            m->slot_b[(int64_t)b->carrier * m->n_slots + b->slot] != i) {
            KVB_LOG_E("map table: unit (seq %llu, block %d, group %d) is not in its slot",
                      (unsigned long long)b->seq, b->tb, b->g);
            return KVB_ERR_STATE;
        }
        if (find(m, b->seq, b->tb, b->g) != i) {
            KVB_LOG_E("map table: unit (seq %llu, block %d, group %d) cannot be found", (unsigned long long)b->seq,
                      b->tb, b->g);
            return KVB_ERR_STATE;
        }
        used += (double)b->filled * unit_len(m, b->g);
    }
    if (seen != m->n || held != m->carriers_held || used != m->used_tl) {
        KVB_LOG_E("map table: %lld units / %lld carriers counted, %lld / %lld recorded", (long long)seen,
                  (long long)held, (long long)m->n, (long long)m->carriers_held);
        return KVB_ERR_STATE;
    }
    return KVB_OK;
}
