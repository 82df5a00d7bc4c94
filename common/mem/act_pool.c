/* kvbank — the activation eTensor pool: BFC inside chunk-aligned segments of the unified pool. */
#include "common/mem/act_pool.h"

#include <string.h>

typedef struct blk {
    size_t off;  /* from the segment's base */
    size_t size;
    int free;
} blk;

typedef struct seg {
    int32_t res;      /* reservation in the elastic pool */
    int n_chunks;
    uintptr_t base;
    blk *b;           /* [nb] tiling [0, n_chunks * chunk_bytes) in address order */
    int nb, cap;
    int32_t *live;    /* [n_chunks] live blocks overlapping each chunk */
} seg;

struct kvb_act_pool {
    kvb_epool *ep;       /* borrowed */
    size_t chunk;        /* bytes per chunk */
    size_t align;
    seg *segs;           /* [n_segs]; segs[0] is the first (large) segment, never released before destroy */
    int n_segs;
    int n_mapped;        /* chunks mapped in all segments */
    int n_live;          /* chunks with live > 0 */
    int n_blocks;        /* live blocks */
};

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

int64_t kvb_act_span_chunks(const size_t *sizes, int n, size_t align, size_t chunk_bytes) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += round_up(sizes[i] ? sizes[i] : 1, align);
    return (int64_t)KVB_DIV_CEIL(total, chunk_bytes);
}

static kvb_status seg_open(kvb_act_pool *a, int n_chunks) {
    KVB_TRY(kvb_realloc_array((void **)&a->segs, (size_t)a->n_segs + 1, sizeof *a->segs));
    seg s = {.n_chunks = n_chunks, .cap = 4};
    kvb_status st;
    KVB_TRY(kvb_malloc((size_t)s.cap * sizeof *s.b, (void **)&s.b));
    KVB_TRY_GOTO(kvb_calloc((size_t)n_chunks, sizeof *s.live, (void **)&s.live), fail);
    KVB_TRY_GOTO(kvb_epool_reserve(a->ep, n_chunks, &s.res), fail);
    s.base = kvb_epool_base(a->ep, s.res);
    s.b[0] = (blk){.off = 0, .size = (size_t)n_chunks * a->chunk, .free = 1};
    s.nb = 1;
    a->segs[a->n_segs++] = s;
    return KVB_OK;
fail:
    free(s.b);
    free(s.live);
    return st;
}

/* Releases segment `k` (nothing live in it): its mapped chunks go back to the activations. */
static void seg_close(kvb_act_pool *a, int k) {
    seg *s = &a->segs[k];
    for (int i = 0; i < s->n_chunks; i++)
        if (kvb_epool_chunk_at(a->ep, s->res, i) >= 0) a->n_mapped--;
    kvb_epool_release(a->ep, s->res);
    free(s->b);
    free(s->live);
    memmove(&a->segs[k], &a->segs[k + 1], (size_t)(a->n_segs - k - 1) * sizeof *a->segs);
    a->n_segs--;
}

kvb_status kvb_act_pool_create(kvb_epool *ep, int seg_chunks, size_t align, kvb_act_pool **out) {
    size_t chunk_bytes = ep ? kvb_epool_chunk_bytes(ep) : 0;
    if (!ep || seg_chunks < 1 || align == 0 || (align & (align - 1)) || chunk_bytes % align) {
        KVB_LOG_E("activation pool: chunk of %zu bytes, first segment of %d chunks, alignment %zu (a power of two "
                  "dividing the chunk) needed",
                  chunk_bytes, seg_chunks, align);
        return KVB_ERR_INVALID;
    }
    kvb_act_pool *a = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *a, (void **)&a));
    a->ep = ep;
    a->chunk = chunk_bytes;
    a->align = align;
    kvb_status st = seg_open(a, seg_chunks);
    if (st != KVB_OK) {
        free(a);
        return st;
    }
    *out = a;
    return KVB_OK;
}

void kvb_act_pool_destroy(kvb_act_pool *a) {
    if (!a) return;
    while (a->n_segs > 0) seg_close(a, a->n_segs - 1);
    free(a->segs);
    free(a);
}

/* ---------------------------------------------------------------- allocation */

static int first_chunk(const kvb_act_pool *a, size_t off) { return (int)(off / a->chunk); }
static int end_chunk(const kvb_act_pool *a, size_t off, size_t size) { return (int)KVB_DIV_CEIL(off + size, a->chunk); }

static int unmapped_in(const kvb_act_pool *a, const seg *s, size_t off, size_t size) {
    int n = 0;
    for (int i = first_chunk(a, off); i < end_chunk(a, off, size); i++) n += kvb_epool_chunk_at(a->ep, s->res, i) < 0;
    return n;
}

/* Finds an idle mapped chunk outside chunks [lo, hi) of segment `not_seg` (highest address of the
 * last segment first). Returns 0 if there is none. */
static int find_idle(const kvb_act_pool *a, int not_seg, int lo, int hi, int *sk, int *si) {
    for (int k = a->n_segs - 1; k >= 0; k--) {
        const seg *s = &a->segs[k];
        for (int i = s->n_chunks - 1; i >= 0; i--) {
            if (k == not_seg && i >= lo && i < hi) continue;
            if (s->live[i] == 0 && kvb_epool_chunk_at(a->ep, s->res, i) >= 0) {
                *sk = k;
                *si = i;
                return 1;
            }
        }
    }
    return 0;
}

/* Maps every unmapped chunk of [off, off + size) in segment `k`. On failure the chunks mapped so far
 * stay mapped (idle) and the books stay true. */
static kvb_status map_range(kvb_act_pool *a, int k, size_t off, size_t size) {
    int lo = first_chunk(a, off), hi = end_chunk(a, off, size);
    for (int i = lo; i < hi; i++) {
        seg *s = &a->segs[k];
        if (kvb_epool_chunk_at(a->ep, s->res, i) >= 0) continue;
        kvb_status st = kvb_epool_map_free(a->ep, KVB_EPOOL_ACT, s->res, i, NULL);
        if (st == KVB_ERR_EXHAUSTED) {
            int sk, si;
            if (!find_idle(a, k, lo, hi, &sk, &si)) return KVB_ERR_EXHAUSTED;
            st = kvb_epool_move(a->ep, a->segs[sk].res, si, s->res, i, KVB_EPOOL_ACT);
            if (st == KVB_OK) a->n_mapped--; /* it left one place of the pool for another */
        }
        KVB_TRY(st);
        a->n_mapped++;
    }
    return KVB_OK;
}

static kvb_status blk_insert(seg *s, int at, blk b) {
    if (s->nb == s->cap) {
        KVB_TRY(kvb_realloc_array((void **)&s->b, (size_t)s->cap * 2, sizeof *s->b));
        s->cap *= 2;
    }
    memmove(&s->b[at + 1], &s->b[at], (size_t)(s->nb - at) * sizeof *s->b);
    s->b[at] = b;
    s->nb++;
    return KVB_OK;
}

static void blk_remove(seg *s, int at) {
    memmove(&s->b[at], &s->b[at + 1], (size_t)(s->nb - at - 1) * sizeof *s->b);
    s->nb--;
}

static void add_live(kvb_act_pool *a, seg *s, size_t off, size_t size, int d) {
    for (int i = first_chunk(a, off); i < end_chunk(a, off, size); i++) {
        if (d > 0 && s->live[i]++ == 0) a->n_live++;
        if (d < 0 && --s->live[i] == 0) a->n_live--;
    }
}

kvb_status kvb_act_pool_alloc(kvb_act_pool *a, size_t bytes, uintptr_t *addr) {
    if (bytes == 0) return KVB_ERR_INVALID;
    size_t need = round_up(bytes, a->align);
    int bk = -1, bi = -1, bmiss = 0;
    for (int k = 0; k < a->n_segs; k++) {
        const seg *s = &a->segs[k];
        for (int i = 0; i < s->nb; i++) {
            const blk *b = &s->b[i];
            if (!b->free || b->size < need) continue;
            int miss = unmapped_in(a, s, b->off, need);
            if (bk < 0 || b->size < a->segs[bk].b[bi].size || (b->size == a->segs[bk].b[bi].size && miss < bmiss)) {
                bk = k;
                bi = i;
                bmiss = miss;
            }
        }
    }
    if (bk < 0) { /* no free block holds it: a segment of its own */
        int n = (int)KVB_DIV_CEIL(need, a->chunk);
        KVB_TRY(seg_open(a, n));
        bk = a->n_segs - 1;
        bi = 0;
    }
    seg *s = &a->segs[bk];
    size_t off = s->b[bi].off;
    kvb_status st = map_range(a, bk, off, need);
    s = &a->segs[bk];
    if (st == KVB_OK && s->b[bi].size > need)
        st = blk_insert(s, bi + 1, (blk){.off = off + need, .size = s->b[bi].size - need, .free = 1});
    if (st != KVB_OK) {
        if (bk > 0 && s->nb == 1 && s->b[0].free && bk == a->n_segs - 1 && unmapped_in(a, s, 0, s->b[0].size) == s->n_chunks)
            seg_close(a, bk); /* the segment opened for this request holds nothing */
        return st;
    }
    s->b[bi].size = need;
    s->b[bi].free = 0;
    add_live(a, s, off, need, +1);
    a->n_blocks++;
    *addr = s->base + off;
    return KVB_OK;
}

kvb_status kvb_act_pool_free(kvb_act_pool *a, uintptr_t addr) {
    for (int k = 0; k < a->n_segs; k++) {
        seg *s = &a->segs[k];
        if (addr < s->base || addr >= s->base + (size_t)s->n_chunks * a->chunk) continue;
        size_t off = addr - s->base;
        int lo = 0, hi = s->nb - 1;
        while (lo < hi) { /* first block with b.off >= off */
            int mid = (lo + hi) / 2;
            if (s->b[mid].off < off) lo = mid + 1;
            else hi = mid;
        }
        if (s->b[lo].off != off || s->b[lo].free) break;
        int i = lo;
        s->b[i].free = 1;
        add_live(a, s, s->b[i].off, s->b[i].size, -1);
        a->n_blocks--;
        if (i + 1 < s->nb && s->b[i + 1].free) {
            s->b[i].size += s->b[i + 1].size;
            blk_remove(s, i + 1);
        }
        if (i > 0 && s->b[i - 1].free) {
            s->b[i - 1].size += s->b[i].size;
            blk_remove(s, i);
        }
        return KVB_OK;
    }
    KVB_LOG_E("activation pool: no live block at %#lx", (unsigned long)addr);
    return KVB_ERR_INVALID;
}

/* ---------------------------------------------------------------- garbage collection */

int kvb_act_pool_gc(kvb_act_pool *a, int n) {
    int done = 0;
    for (int k = a->n_segs - 1; k >= 0 && done < n; k--) {
        seg *s = &a->segs[k];
        for (int i = s->n_chunks - 1; i >= 0 && done < n; i--) {
            if (s->live[i] || kvb_epool_chunk_at(a->ep, s->res, i) < 0) continue;
            if (kvb_epool_unmap(a->ep, s->res, i) != KVB_OK) continue;
            a->n_mapped--;
            done++;
        }
    }
    /* extra segments that hold nothing: give their address space back */
    for (int k = a->n_segs - 1; k > 0; k--) {
        seg *s = &a->segs[k];
        if (s->nb == 1 && s->b[0].free && unmapped_in(a, s, 0, s->b[0].size) == s->n_chunks) seg_close(a, k);
    }
    return done;
}

int kvb_act_pool_n_mapped(const kvb_act_pool *a) { return a->n_mapped; }
int kvb_act_pool_n_live(const kvb_act_pool *a) { return a->n_live; }
int kvb_act_pool_n_idle(const kvb_act_pool *a) { return a->n_mapped - a->n_live; }
int kvb_act_pool_n_blocks(const kvb_act_pool *a) { return a->n_blocks; }
int kvb_act_pool_n_segments(const kvb_act_pool *a) { return a->n_segs; }

kvb_status kvb_act_pool_check(const kvb_act_pool *a) {
    int mapped = 0, live = 0, blocks = 0;
    for (int k = 0; k < a->n_segs; k++) {
        const seg *s = &a->segs[k];
        size_t end = 0;
        int32_t *want = NULL;
        if (kvb_calloc((size_t)s->n_chunks, sizeof *want, (void **)&want) != KVB_OK) return KVB_ERR_NOMEM;
        kvb_status st = KVB_OK;
        for (int i = 0; i < s->nb && st == KVB_OK; i++) {
            const blk *b = &s->b[i];
            if (b->off != end || b->size == 0 || (i > 0 && b->free && s->b[i - 1].free)) {
                KVB_LOG_E("activation pool: segment %d block %d at %zu (+%zu) breaks the tiling", k, i, b->off, b->size);
                st = KVB_ERR_STATE;
            }
            end = b->off + b->size;
            if (!b->free) {
                blocks++;
                for (int c = first_chunk(a, b->off); c < end_chunk(a, b->off, b->size); c++) want[c]++;
            }
        }
        if (st == KVB_OK && end != (size_t)s->n_chunks * a->chunk) {
            KVB_LOG_E("activation pool: segment %d blocks end at %zu", k, end);
            st = KVB_ERR_STATE;
        }
        for (int c = 0; c < s->n_chunks && st == KVB_OK; c++) {
            int m = kvb_epool_chunk_at(a->ep, s->res, c) >= 0;
            mapped += m;
            live += want[c] > 0;
            if (want[c] != s->live[c] || (want[c] && !m)) {
                KVB_LOG_E("activation pool: segment %d chunk %d has %d live blocks, counted %d, mapped %d", k, c, want[c],
                          s->live[c], m);
                st = KVB_ERR_STATE;
            }
        }
        free(want);
        if (st != KVB_OK) return st;
    }
    if (mapped != a->n_mapped || live != a->n_live || blocks != a->n_blocks) {
        KVB_LOG_E("activation pool: counts %d mapped / %d live / %d blocks, found %d / %d / %d", a->n_mapped, a->n_live,
                  a->n_blocks, mapped, live, blocks);
        return KVB_ERR_STATE;
    }
    return KVB_OK;
}
